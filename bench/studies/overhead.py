"""`make bench STUDY=overhead`: what the proxy adds, against the same fake called directly.

In one run: two fake vLLM servers (model `fast` unpaced, model `paced` at 20 ms/token)
and `laneway serve` in front of both, each its own process; the load generator
(aiohttp) alternates direct and proxied blocks so drift hits both alike. Reports
added latency p50/p99 (non-streamed, and TTFT of streams), streamed tokens/s at 1,
64 and 256 concurrent paced streams (ratio proxy/direct), and the proxy's CPU µs
per relayed token (from /proc: the figure that does not depend on sharing the cores
with the load generator), beside a bare uvicorn + aiohttp relay as the stack's floor.

`--target-url URL` measures any server that serves both models instead of laneway
(`--target-url direct`: the fakes against themselves, to check the harness).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench.harness.results import publish
from bench.studies.overhead_load import cpu_seconds, latency_legs, stream_legs, throughput
from bench.studies.overhead_procs import fake_process, minimal_relay, otlp_sink, proxy_for
from predictors.home import REPO

TARGETS = {"added_p50_ms": 1.0, "added_p99_ms": 3.0, "throughput_ratio_256": 0.95}


@dataclass(frozen=True, slots=True)
class Legs:
    direct_fast: str  # the unpaced fake (model `fast`), for latency
    direct_paced: str  # the paced fake (model `paced`), for throughput
    target_fast: str  # the server under test in front of each (laneway: one URL for both)
    target_paced: str
    target_pid: int | None  # for CPU per token; None: not measured
    floor: str | None = None  # a bare relay in front of the paced fake
    floor_pid: int | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    requests: int = 2000  # per latency measure, split in 10 alternating blocks
    tokens: int = 200  # per paced stream
    concurrency: tuple[int, ...] = (1, 64, 256)
    repeat: int = 3  # streaming runs per concurrency; the median is kept
    tpot_ms: float = 20.0  # the paced fake's pacing
    idle_s: float = 3.0  # to measure the target's idle CPU (its poller); 0: skip
    phase_timeout_s: float = 300.0


DEFAULT = Plan()
QUICK = Plan(requests=200, tokens=50, concurrency=(1, 64), repeat=1, idle_s=1.0)


async def measure(legs: Legs, plan: Plan) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=plan.phase_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        async def bounded(coro: Any) -> Any:
            return await asyncio.wait_for(coro, plan.phase_timeout_s)

        result: dict[str, Any] = {"plan": asdict(plan)}
        await bounded(latency_legs(http, legs.direct_fast, legs.target_fast, 50, False))  # warm-up
        for stream, key in ((False, "non_stream"), (True, "ttft")):
            result[key] = await bounded(latency_legs(http, legs.direct_fast, legs.target_fast,
                                                     plan.requests, stream))
        idle_rate = await idle_cpu_rate(legs.target_pid, plan.idle_s)
        result["target_idle_cpu_percent"] = None if idle_rate is None else idle_rate * 100
        result["streaming"] = {}
        for streams in plan.concurrency:
            runs = [await bounded(stream_legs(http, legs.direct_paced, legs.target_paced, streams,
                                              plan.tokens, legs.target_pid, idle_rate or 0.0))
                    for _ in range(plan.repeat)]
            runs.sort(key=lambda run: float(run["ratio"]))
            # Far below 1 means the machine, not the target, limited the direct leg.
            ideal = streams * 1000 / plan.tpot_ms
            result["streaming"][str(streams)] = {
                **runs[len(runs) // 2], "ratios": [r["ratio"] for r in runs],
                "direct_vs_ideal": float(runs[len(runs) // 2]["direct_tokens_per_s"]) / ideal}
        result["floor_relay_cpu_us_per_token"] = await bounded(floor_cpu(http, legs, plan))
        return result


async def floor_cpu(http: aiohttp.ClientSession, legs: Legs, plan: Plan) -> float | None:
    """The bare relay's CPU µs per token at the highest concurrency."""
    if legs.floor is None or legs.floor_pid is None:
        return None
    before = cpu_seconds(legs.floor_pid)
    _, relayed, _ = await throughput(http, legs.floor, "paced", plan.concurrency[-1], plan.tokens)
    return (cpu_seconds(legs.floor_pid) - before) / max(1, relayed) * 1e6


async def idle_cpu_rate(pid: int | None, seconds: float) -> float | None:
    """The target's CPU seconds per second with no traffic (its poller's scrapes)."""
    if pid is None or seconds <= 0:
        return None
    before = cpu_seconds(pid)
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - before) / seconds


def verdict(result: dict[str, Any]) -> dict[str, bool]:
    worst_p50 = max(result["non_stream"]["added_p50_ms"], result["ttft"]["added_p50_ms"])
    worst_p99 = max(result["non_stream"]["added_p99_ms"], result["ttft"]["added_p99_ms"])
    top = result["streaming"][max(result["streaming"], key=int)]
    return {"added_p50_ms": worst_p50 <= TARGETS["added_p50_ms"],
            "added_p99_ms": worst_p99 <= TARGETS["added_p99_ms"],
            "throughput_ratio_256": top["ratio"] >= TARGETS["throughput_ratio_256"]}


def _us(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} µs/token"


def table(result: dict[str, Any]) -> str:
    lines = ["| measure | direct | via target | added / ratio |", "|---|---|---|---|"]
    for key, label in (("non_stream", "non-streamed latency"), ("ttft", "streamed TTFT")):
        r = result[key]
        for q in ("p50", "p99"):
            lines.append(f"| {label} {q} | {r[f'direct_{q}_ms']:.2f} ms | "
                         f"{r[f'target_{q}_ms']:.2f} ms | {r[f'added_{q}_ms']:+.2f} ms |")
    for streams, r in result["streaming"].items():
        lines.append(f"| {streams} streams x {result['plan']['tokens']} tokens @"
                     f"{result['plan']['tpot_ms']:g} ms (direct at {r['direct_vs_ideal']:.0%} "
                     f"of ideal) | "
                     f"{r['direct_tokens_per_s']:.0f} tok/s | {r['target_tokens_per_s']:.0f} "
                     f"tok/s | {r['ratio']:.3f}x; CPU {_us(r['target_cpu_us_per_token'])}, "
                     f"relay alone {_us(r['relay_cpu_us_per_token'])}; failed streams "
                     f"{r['target_failed_streams']}/{streams} |")
    lines.append(f"| bare uvicorn + aiohttp relay (floor), {list(result['streaming'])[-1]} "
                 f"streams | | | CPU {_us(result['floor_relay_cpu_us_per_token'])} |")
    return "\n".join(lines)


@contextlib.contextmanager
def system_under_test(target_url: str | None, fast: str, paced: str, tracking: bool,
                      tracing: bool = False
                      ) -> Iterator[tuple[str, str, int | None, str | None]]:
    """(URL for model `fast`, URL for model `paced`, pid or None, the OTLP receiver's URL
    or None)."""
    if target_url is None:
        with contextlib.ExitStack() as stack:
            traces = stack.enter_context(otlp_sink()) if tracing else None
            proxy = stack.enter_context(proxy_for(fast, paced, tracking, traces))
            yield proxy.url, proxy.url, proxy.pid, traces
    elif target_url == "direct":
        yield fast, paced, None, None
    else:
        yield target_url, target_url, None, None


def run(plan: Plan, target_url: str | None, target_pid: int | None, tracking: bool = True,
        tracing: bool = False) -> dict[str, Any]:
    with fake_process(0, "fast") as fast, fake_process(plan.tpot_ms, "paced") as paced, \
            minimal_relay(paced) as (floor, floor_pid), \
            system_under_test(target_url, fast, paced, tracking, tracing) as (
                target_fast, target_paced, pid, traces):
        legs = Legs(fast, paced, target_fast, target_paced, pid or target_pid, floor, floor_pid)
        result = asyncio.run(measure(legs, plan))
        if traces is not None:  # what reached the receiver (the last batch may be on its way)
            time.sleep(2)
            result["spans_received"] = httpx.get(f"{traces}/health", timeout=5).json()
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=DEFAULT.requests)
    parser.add_argument("--tokens", type=int, default=DEFAULT.tokens)
    parser.add_argument("--concurrency", default="1,64,256")
    parser.add_argument("--repeat", type=int, default=DEFAULT.repeat)
    parser.add_argument("--quick", action="store_true", help="a small run (~30 s)")
    parser.add_argument("--target-url", help="measure this server instead of laneway")
    parser.add_argument("--no-tracking", action="store_true",
                        help="laneway with migration.enabled=false (plain byte relay)")
    parser.add_argument("--tracing", action="store_true",
                        help="laneway tracing every request to an OTLP receiver")
    parser.add_argument("--target-pid", type=int, help="its pid, for CPU per token")
    parser.add_argument("--json", type=Path, default=REPO / "docs" / "results" / "overhead.json")
    args = parser.parse_args(argv)
    plan = Plan(args.requests, args.tokens, tuple(int(c) for c in args.concurrency.split(",")),
                args.repeat)
    if args.quick:
        plan = QUICK
    # SIGTERM must unwind the `with` blocks so that every child process is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(plan, args.target_url, args.target_pid, tracking=not args.no_tracking,
                 tracing=args.tracing)
    result |= {"targets": TARGETS, "meets_targets": verdict(result),
               "target": args.target_url or "laneway",
               "tracking": args.target_url is None and not args.no_tracking,
               "tracing": args.target_url is None and args.tracing,
               "command": "python -m bench.studies.overhead " + " ".join(
                   sys.argv[1:] if argv is None else argv)}
    publish(args.json, result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
