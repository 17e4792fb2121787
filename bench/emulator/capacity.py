"""How much load one emulator process sustains (`python -m bench emulate capacity`).

Starts `python -m bench emulate --n N` as a child process, offers open-loop Poisson load at
rising rates to instances picked at random (streamed `/v1/completions`, token-id
prompts, fixed lengths), and reads the emulator's CPU time from /proc and its
schedule lag from `/emulator/stats`. The emulator keeps up while it uses less than
one core and its engines run on schedule; on a small shared machine the load
generator competes for the same cores, so CPU per request is the figure that carries
over (requests/s per core = 1e6 / µs per request).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import httpx
import orjson

from bench.emulator.measure import cpu_times
from bench.harness.ports import free_port_range
from bench.harness.results import write_json
from bench.studies.overhead_procs import child, wait_ok

_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Point:
    offered_rps: float
    achieved_rps: float
    errors: int
    tokens_per_s: float
    emulator_cpu_cores: float  # CPU seconds per wall second, all emulator processes
    cpu_us_per_request: float
    cpu_us_per_token: float
    lag_ms_per_step: float  # how late step ends ran, on average
    client_cpu_cores: float  # the load generator's own CPU (same machine)
    machine_cpu_busy: float  # all cores, everything running
    ttft_p50_ms: float
    e2e_p50_ms: float


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its children (the `--processes` workers)."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(entry.name) == pid or int(fields[1]) == pid:
                total += (int(fields[11]) + int(fields[12])) / _TICKS
    return total


async def _one(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, float]:
    started = time.perf_counter()
    first = 0.0
    async with session.post(f"{url}/v1/completions", data=body,
                            headers={"content-type": "application/json"}) as response:
        response.raise_for_status()
        async for _ in response.content.iter_any():
            first = first or time.perf_counter()
    return first - started, time.perf_counter() - started


async def offer(urls: Sequence[str], model: str, rate: float, duration_s: float,
                prompt_tokens: int, output_tokens: int, seed: int
                ) -> tuple[int, list[tuple[float, float]], float]:
    """Poisson arrivals for `duration_s`; (errors, (ttft, e2e) per success, wall time)."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        started = due = loop.time()
        while due < started + duration_s:
            await asyncio.sleep(max(0.0, due - loop.time()))
            body = orjson.dumps({"model": model, "max_tokens": output_tokens, "stream": True,
                                 "ignore_eos": True, "prompt": [rng.randrange(10, 4000)
                                                                for _ in range(prompt_tokens)]})
            tasks.append(asyncio.create_task(_one(session, rng.choice(urls), body)))
            due += rng.expovariate(rate)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        wall = loop.time() - started
    ok = [r for r in results if isinstance(r, tuple)]
    failed = [r for r in results if not isinstance(r, tuple)]
    if failed:
        print(f"{len(failed)} requests failed, e.g. {failed[0]!r}", file=sys.stderr)
    return len(failed), ok, wall


@contextlib.contextmanager
def emulator_fleet(n: int, profile: str, processes: int) -> Iterator[tuple[list[str], int]]:
    base = free_port_range(n)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(n)]
    with tempfile.TemporaryDirectory() as tmp, child(
            ["-m", "bench", "emulate", "--n", str(n), "--profile", profile,
             "--base-port", str(base), "--processes", str(processes),
             "--config-out", f"{tmp}/emulated.yaml"], f"{urls[0]}/health") as proc:
        wait_ok(f"{urls[-1]}/health", proc)
        yield urls, proc.pid


def measure_point(urls: Sequence[str], pid: int, model: str, rate: float, duration_s: float,
                  prompt_tokens: int, output_tokens: int, seed: int) -> Point:
    before_stats = httpx.get(f"{urls[0]}/emulator/stats").json()
    cpu_before, client_before, machine_before = cpu_seconds(pid), time.process_time(), \
        cpu_times()
    errors, timings, wall = asyncio.run(offer(urls, model, rate, duration_s, prompt_tokens,
                                              output_tokens, seed))
    cpu = cpu_seconds(pid) - cpu_before
    client = time.process_time() - client_before
    machine = [after - before for after, before in zip(cpu_times(), machine_before,
                                                       strict=True)]
    after_stats = httpx.get(f"{urls[0]}/emulator/stats").json()
    steps = max(1, after_stats["steps"] - before_stats["steps"])
    done = max(1, len(timings))
    return Point(
        offered_rps=rate, achieved_rps=round(len(timings) / wall, 1), errors=errors,
        tokens_per_s=round(len(timings) * output_tokens / wall),
        emulator_cpu_cores=round(cpu / wall, 3),
        cpu_us_per_request=round(cpu / done * 1e6), cpu_us_per_token=round(
            cpu / (done * output_tokens) * 1e6, 1),
        lag_ms_per_step=round((after_stats["lag_s"] - before_stats["lag_s"]) / steps * 1e3, 3),
        client_cpu_cores=round(client / wall, 3),
        machine_cpu_busy=round(machine[0] / max(1, machine[1]), 3),
        ttft_p50_ms=round(statistics.median(t for t, _ in timings) * 1e3, 2) if timings else 0,
        e2e_p50_ms=round(statistics.median(e for _, e in timings) * 1e3, 2) if timings else 0)


def run(n: int, profile: str, processes: int, rates: Sequence[float], duration_s: float,
        prompt_tokens: int, output_tokens: int, out: Path) -> int:
    from bench.emulator.profile import load_profile

    model = load_profile(profile).model
    points = []
    with emulator_fleet(n, profile, processes) as (urls, pid):
        for index, rate in enumerate(rates):
            point = measure_point(urls, pid, model, rate, duration_s, prompt_tokens,
                                  output_tokens, seed=index)
            points.append(point)
            print(json.dumps(asdict(point)), flush=True)
    report = {"instances": n, "profile": profile, "processes": processes,
              "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
              "duration_s": duration_s, "cpus": os.cpu_count(),
              "load_average_after": [round(x, 2) for x in os.getloadavg()],
              "points": [asdict(p) for p in points]}
    write_json(out, report)
    print(f"wrote {out}")
    return 0
