"""The load generator: sends a workload's requests at their arrival times (open loop).

Bounded in count (`max_requests`), in schedule (`duration_s`: nothing is sent after
this offset) and in wall time (`time_limit_s`: requests still open are cut and
recorded as errors, requests not yet sent are skipped). `concurrency` caps the
requests open at once (late ones wait). `run_solo` measures solo latencies instead:
one request at a time on each of one or more identical idle backends, in workload
order, with no pauses. Every result goes to `sink` as soon as it completes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

import aiohttp

from bench.harness.results import RequestResult
from bench.harness.sse_client import Target, stream_one
from bench.harness.workloads import WorkloadRequest


@dataclass(frozen=True, slots=True)
class Limits:
    max_requests: int | None = None
    duration_s: float | None = None
    time_limit_s: float | None = None
    concurrency: int | None = None

    def select(self, requests: Sequence[WorkloadRequest]) -> list[WorkloadRequest]:
        chosen = [r for r in requests if self.duration_s is None or r.arrival_s <= self.duration_s]
        return chosen[:self.max_requests]


@dataclass(frozen=True, slots=True)
class RunSummary:
    planned: int
    sent: int
    errors: int
    wall_s: float

    @property
    def skipped(self) -> int:
        return self.planned - self.sent


class Progress:
    """A one-line progress bar on a text stream, redrawn at most every `interval_s`."""

    def __init__(self, total: int, stream: TextIO | None = sys.stderr, width: int = 30,
                 interval_s: float = 0.2) -> None:
        self.total, self.stream, self.width, self.interval_s = total, stream, width, interval_s
        self.sent = self.done = self.errors = 0
        self._started = time.monotonic()
        self._drawn = float("-inf")
        self._drawn_done = -1

    def on_sent(self) -> None:
        self.sent += 1
        self._draw()

    def on_done(self, ok: bool) -> None:
        self.done += 1
        self.errors += 0 if ok else 1
        self._draw()

    def record(self, result: RequestResult, sink: Callable[[RequestResult], None]) -> None:
        """A request ended: hand its result on, then count it."""
        sink(result)
        self.on_done(result.ok)

    def summary(self, start_perf: float) -> RunSummary:
        """The run is over: the last redraw, and its counts."""
        self.finish()
        return RunSummary(self.total, self.sent, self.errors, time.perf_counter() - start_perf)

    def line(self) -> str:
        filled = self.width * self.done // max(1, self.total)
        return (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} done, "
                f"{self.sent - self.done} open, {self.errors} errors, "
                f"{time.monotonic() - self._started:.1f}s")

    def finish(self) -> None:
        if self.stream is not None:
            if self._drawn_done != self.done:
                self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.stream is None or (not force and now - self._drawn < self.interval_s):
            return
        self._drawn, self._drawn_done = now, self.done
        self.stream.write("\r" + self.line())
        self.stream.flush()


async def run(requests: Sequence[WorkloadRequest], target: Target, limits: Limits,
              sink: Callable[[RequestResult], None], progress_stream: TextIO | None = sys.stderr
              ) -> RunSummary:
    chosen = limits.select(requests)
    progress = Progress(len(chosen), progress_stream)
    loop = asyncio.get_running_loop()
    start_loop, start_perf = loop.time(), time.perf_counter()
    deadline = start_loop + limits.time_limit_s if limits.time_limit_s is not None else None
    gate = asyncio.Semaphore(limits.concurrency) if limits.concurrency else None
    async with _session() as session:

        async def one(request: WorkloadRequest) -> None:
            due = start_loop + request.arrival_s
            if deadline is not None and due >= deadline:
                return  # skipped: due after the run's time limit
            await asyncio.sleep(max(0.0, due - loop.time()))
            async with gate or contextlib.nullcontext():
                if deadline is not None and loop.time() >= deadline:
                    return  # skipped: the run is over
                progress.on_sent()
                result = await stream_one(session, target, request, start_perf, deadline)
            progress.record(result, sink)

        await asyncio.gather(*(one(r) for r in chosen))
    return progress.summary(start_perf)


async def run_solo(requests: Sequence[WorkloadRequest], targets: Sequence[Target],
                   sink: Callable[[RequestResult], None],
                   progress_stream: TextIO | None = sys.stderr) -> RunSummary:
    """Each request alone on a backend: one lane per target, each sending the next
    request of the workload as soon as its last one ended (arrival times ignored). The
    targets must be identical and otherwise idle, so that a request's latency does not
    depend on its lane; several of them only make the measurement shorter."""
    if not targets:
        raise ValueError("run_solo needs at least one target")
    progress = Progress(len(requests), progress_stream)
    start_perf = time.perf_counter()
    pending = collections.deque(requests)
    async with _session() as session:

        async def lane(target: Target) -> None:
            while pending:
                request = pending.popleft()
                progress.on_sent()
                result = await stream_one(session, target, request, start_perf, None)
                progress.record(result, sink)

        await asyncio.gather(*(lane(t) for t in targets))
    return progress.summary(start_perf)


@contextlib.asynccontextmanager
async def _session() -> AsyncIterator[aiohttp.ClientSession]:
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, read_bufsize=1 << 20) as session:
        yield session
