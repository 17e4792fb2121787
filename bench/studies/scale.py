"""Router scale (`make bench STUDY=scale`): decision latency, poller staleness and proxy
overhead with 8, 64 and 512 emulated backends.

    python -m bench.studies.scale [--backends 8 64 512] [--rates 250 500 1000 2000] [--quick]

1. Decision latency: `bench.studies.policy_latency.measure` for every registered policy (CPU
   clock, so preemption by the other processes of this run is not counted).
2. Poller staleness: the proxy's own `Poller` + `Registry` against the idle emulated
   fleet (before the proxy starts), sampling `now - BackendStats.updated_at` every
   `--sample-ms` (what a policy reading the registry at that instant sees; the worst
   backend of each sample), with the round's duration and this process's CPU per
   round (requests + parsing; the emulator answering runs on the same cores), at each
   `--intervals-ms` value of `poller.interval_s`.
3. End-to-end: open-loop Poisson load at each `--rates` value, straight to the
   emulated instances and then through `laneway serve` (round_robin), alternating;
   offered vs achieved requests/s and the added latency (p50/p99 via laneway minus
   direct at the same offered rate).

Writes `docs/results/scale.json`; `--decisions-only` measures step 1 alone and replaces
only its figures there (with `decisions_command`, `decisions_commit`). On a small
machine the emulator, the proxy and the load generator share the cores, so the
achieved rate is the machine's, not laneway's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

from bench.emulator.capacity import emulator_fleet, offer
from bench.harness.ports import free_port_range
from bench.harness.proxy_process import running_proxy
from bench.harness.report import git_commit
from bench.studies import policy_latency
from bench.studies.overhead_procs import child
from predictors.home import REPO
from proxy.config import PollerConfig
from proxy.fleet.poller import Poller
from proxy.fleet.registry import Registry
from proxy.types import Backend

# One GPU type: the added latency (~1 ms) would drown in the spread between GPU types.
PROFILE = "h100-80gb"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # every GPU profile serves it


@dataclass(frozen=True, slots=True)
class LoadRow:
    backends: int
    path: str  # "direct" | "laneway"
    offered_rps: float
    achieved_rps: float
    errors: int
    e2e_p50_ms: float
    e2e_p99_ms: float


def percentiles_ms(samples_s: Sequence[float]) -> dict[str, Any]:
    """p50 / p99 / max of seconds, in ms (zeros when empty)."""
    if not samples_s:
        return {"p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0, "samples": 0}
    values = np.asarray(samples_s) * 1e3
    return {"p50_ms": round(float(np.percentile(values, 50)), 2),
            "p99_ms": round(float(np.percentile(values, 99)), 2),
            "max_ms": round(float(values.max()), 2), "samples": len(values)}


def snapshot_staleness(updated_at: Sequence[float], healthy: Sequence[bool], now: float
                       ) -> float | None:
    """Age of the oldest healthy backend's stats at `now` (None: nothing published)."""
    ages = [now - t for t, ok in zip(updated_at, healthy, strict=True) if ok]
    return max(ages) if ages else None


async def sample_staleness(urls: Sequence[str], seconds: float, every_s: float,
                           cfg: PollerConfig) -> dict[str, Any]:
    """Staleness percentiles (ms), the poll round's duration (`round_ms`: a round's
    start to its last answer) and this process's CPU per scrape and per second."""
    registry = Registry(Backend(f"emu-{i}", url, MODEL) for i, url in enumerate(urls))
    samples: list[float] = []
    rounds: list[float] = []
    poller = Poller(registry, cfg)
    cpu_before, started = time.process_time(), time.monotonic()
    task = asyncio.create_task(poller.run())
    try:
        while time.monotonic() < started + seconds:
            await asyncio.sleep(every_s)
            stats = list(registry.stats.values())
            age = snapshot_staleness([s.updated_at for s in stats],
                                     [s.healthy for s in stats], time.monotonic())
            if age is not None and len(stats) == len(urls):
                samples.append(age)
                rounds.append(poller.last_poll_s)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    cpu_s, wall_s = time.process_time() - cpu_before, time.monotonic() - started
    return {**percentiles_ms(samples), "interval_ms": cfg.interval_s * 1e3,
            "round_ms": percentiles_ms(rounds),
            "cpu_us_per_scrape": round(cpu_s * 1e6 / max(1, poller.scrapes), 1),
            "cpu_cores": round(cpu_s / wall_s, 3)}


def load_row(n: int, path: str, urls: Sequence[str], rate: float, seconds: float,
             seed: int) -> LoadRow:
    errors, timings, wall = asyncio.run(offer(urls, MODEL, rate, seconds, 32, 4, seed))
    e2e = percentiles_ms([e for _, e in timings])
    return LoadRow(n, path, rate, round(len(timings) / wall, 1), errors,
                   e2e["p50_ms"], e2e["p99_ms"])


def staleness_runs(source: str, urls: Sequence[str], stale_s: float, every_ms: float,
                   intervals_ms: Sequence[float]) -> dict[str, Any]:
    """`sample_staleness` at each poller interval, on uvloop like `laneway serve`."""
    out = {}
    for interval_ms in intervals_ms:
        cfg = PollerConfig(interval_s=interval_ms / 1e3)
        out[f"{interval_ms:g}"] = uvloop.run(sample_staleness(urls, stale_s, every_ms / 1e3, cfg))
        print(f"{len(urls)} backends ({source}), interval {interval_ms:g} ms: poller "
              f"staleness {out[f'{interval_ms:g}']}", flush=True)
    return out


@contextlib.contextmanager
def static_fleet(n: int) -> Iterator[list[str]]:
    """`bench.fakes.metrics_responder`: n static /metrics endpoints in one child process."""
    base = free_port_range(n, start=30000)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(n)]
    with child(["-m", "bench.fakes.metrics_responder", "--n", str(n), "--base-port", str(base)],
               f"{urls[-1]}/metrics"):
        yield urls


def fleet_run(n: int, rates: Sequence[float], seconds: float, every_ms: float,
              stale_s: float, intervals_ms: Sequence[float]
              ) -> tuple[list[LoadRow], dict[str, Any]]:
    rows: list[LoadRow] = []
    with static_fleet(n) as urls:
        staleness = {"static": staleness_runs("static", urls, stale_s, every_ms, intervals_ms)}
    with emulator_fleet(n, PROFILE, 1) as (urls, _pid):
        staleness["emulator"] = staleness_runs("emulator", urls, stale_s, every_ms,
                                               intervals_ms)
        config = {"backends": [{"name": f"emu-{i}", "url": u, "model": MODEL}
                               for i, u in enumerate(urls)],
                  "policy": {"name": "round_robin", "params": {}}}
        with running_proxy(config, ready_timeout_s=60) as proxy:
            time.sleep(1.0)  # first scrape rounds
            for i, rate in enumerate(rates):
                for path, targets in (("direct", urls), ("laneway", [proxy.url])):
                    rows.append(load_row(n, path, targets, rate, seconds, seed=i))
                    print(json.dumps(asdict(rows[-1])), flush=True)
    return rows, staleness


def overhead(rows: Sequence[LoadRow]) -> list[dict[str, Any]]:
    """Added latency per (backends, offered rate): laneway minus direct."""
    direct = {(r.backends, r.offered_rps): r for r in rows if r.path == "direct"}
    out = []
    for r in rows:
        d = direct.get((r.backends, r.offered_rps))
        if r.path == "laneway" and d is not None:
            out.append({"backends": r.backends, "offered_rps": r.offered_rps,
                        "achieved_rps_direct": d.achieved_rps,
                        "achieved_rps_laneway": r.achieved_rps,
                        "added_p50_ms": round(r.e2e_p50_ms - d.e2e_p50_ms, 2),
                        "added_p99_ms": round(r.e2e_p99_ms - d.e2e_p99_ms, 2)})
    return out


DECISION_KEYS = ("decision_p99_ms", "decision_p99_ms_max_512", "decisions")


def results_json(decisions: Sequence[policy_latency.Row], staleness: dict[int, dict[str, Any]],
                 rows: Sequence[LoadRow], command: str, commit: str) -> dict[str, Any]:
    decisions_512 = {r.policy: round(r.p99_us / 1e3, 4) for r in decisions if r.backends == 512}
    top = max(staleness) if staleness else 0
    default_interval = f"{PollerConfig().interval_s * 1e3:g}"

    def at_512(source: str) -> dict[str, float]:
        return {ms: s["p99_ms"] for ms, s in staleness.get(512, {}).get(source, {}).items()}

    return {
        "decision_p99_ms": decisions_512,
        "decision_p99_ms_max_512": max(decisions_512.values()) if decisions_512 else None,
        # The poller's own staleness (static /metrics endpoints, `bench.fakes.metrics_responder`)
        # at the default poller.interval_s; then every interval, and against the emulator
        # fleet, whose one process cannot serve 512 pages per interval here.
        "poller_staleness_p99_ms_512": at_512("static").get(default_interval),
        "poller_staleness_p99_ms_512_by_interval_ms": at_512("static"),
        "poller_staleness_p99_ms_512_emulator_by_interval_ms": at_512("emulator"),
        "poller_staleness_ms": {str(n): s for n, s in staleness.items()},
        "largest_fleet": top,
        "decisions": [asdict(r) for r in decisions],
        "load": [asdict(r) for r in rows],
        "overhead": overhead(rows),
        "cpus": os.cpu_count(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "command": command, "commit": commit,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--backends", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--rates", type=float, nargs="+", default=[250, 500, 1000, 2000])
    parser.add_argument("--seconds", type=float, default=5.0, help="per load step")
    parser.add_argument("--picks", type=int, default=20_000)
    parser.add_argument("--sample-ms", type=float, default=5.0)
    parser.add_argument("--staleness-s", type=float, default=10.0)
    parser.add_argument("--intervals-ms", type=float, nargs="+", default=[100, 50],
                        help="poller.interval_s values to measure staleness at")
    parser.add_argument("--out", default=str(REPO / "docs/results/scale.json"))
    parser.add_argument("--decisions-only", action="store_true",
                        help="measure step 1 alone and replace only its figures in --out")
    args = parser.parse_args(argv)
    decisions = [policy_latency.measure(name, n, args.picks, "cpu")
                 for name in policy_latency.without_params() for n in args.backends]
    for row in decisions:
        print(json.dumps(asdict(row)), flush=True)
    command = "python -m bench.studies.scale " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.decisions_only:
        out = Path(args.out)
        report = json.loads(out.read_text()) if out.exists() else {}
        fresh = results_json(decisions, {}, [], command.strip(), git_commit())
        report.update({k: fresh[k] for k in DECISION_KEYS},
                      decisions_command=fresh["command"], decisions_commit=fresh["commit"])
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"updated the decision figures in {out}")
        return 0
    rows: list[LoadRow] = []
    staleness: dict[int, dict[str, Any]] = {}
    for n in args.backends:
        fleet_rows, staleness[n] = fleet_run(n, args.rates, args.seconds, args.sample_ms,
                                             args.staleness_s, args.intervals_ms)
        rows += fleet_rows
    report = results_json(decisions, staleness, rows, command.strip(), git_commit())
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
