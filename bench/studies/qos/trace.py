"""qos_drl under a real-world arrival trace (the paper's §VI-A b), in the simulator.

    python -m bench.studies.qos.trace --checkpoint Q --baseline-checkpoint B [--rates 5]
        [--seeds 7 8 9 10 11 12] [--trace datasets/traces/mooncake_conversation.jsonl.gz]
        [--speed 1.0] [--out docs/results/qos_drl/trace.json]   (--speed: bench_qos's)

The paper trains on Poisson arrivals at λ = 5 and then replays a real workload
(BurstGPT) "during a period with average arrival rate λ = 5", reporting at least
+33.47 % average QoS over every baseline. BurstGPT is not here; the Mooncake
conversation trace (one hour of real arrivals, `datasets/traces/`) is. Every router of
`bench.studies.qos.bench_qos` runs on the same draws of three arrival processes, each draw a seed:
Poisson at λ (as trained), the trace's arrivals (a seeded window of `--arrivals`,
time-scaled to mean rate λ; `bench.studies.qos.sim.TraceArrivals`) spread within the trace's
3-s logging steps, and the same windows with each step's arrivals together (bursts).
Held-out prompts, greedy agents, the checkpoints' fleet and L, as `bench.studies.qos.bench_qos`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.harness.report import git_commit
from bench.harness.results import write_json
from bench.studies.qos.bench_qos import add_simulator_arguments, load_agents, routers
from bench.studies.qos.evaluate import beats_every_baseline, evaluate
from bench.studies.qos.live_report import repo_path
from bench.studies.qos.setup import comparison
from bench.studies.qos.sim import QosSim, TraceArrivals, trace_times
from policies.qos_drl.sac import load_checkpoint
from predictors.home import DATASETS, REPO

PROCESSES = ("poisson", "trace", "trace_bursts")


def arrival_processes(times: tuple[float, ...], window: int
                      ) -> dict[str, TraceArrivals | None]:
    return {"poisson": None, "trace": TraceArrivals(times, window, spread=True),
            "trace_bursts": TraceArrivals(times, window, spread=False)}


def burstiness(trace: TraceArrivals | None, seed: int, rate: float) -> float | None:
    """Coefficient of variation of one draw's inter-arrival gaps (Poisson: 1; above:
    burstier), None for Poisson itself."""
    if trace is None:
        return None
    gaps = trace.draw(seed, rate)
    return statistics.pstdev(gaps) / statistics.fmean(gaps)


def gain(a: float, b: float) -> float | None:
    return a / b - 1 if b > 0 else None


def percent(gain: float | None) -> str:
    """A gain for the log; "n/a" where Baseline RL's QoS was 0."""
    return "n/a" if gain is None else f"{gain:+.1%}"


def summarize(cells: Mapping[str, list[float]]) -> dict[str, Any]:
    """One (process, λ): each policy's per-draw average QoS → means and qos_drl's gains."""
    means = {name: statistics.fmean(values) for name, values in cells.items()}
    draws = [gain(q, b) for q, b in zip(cells["qos_drl"], cells["baseline_rl"], strict=True)]
    others = {k: v for k, v in means.items() if k != "qos_drl_sampled"}
    best_other = max((k for k in others if k != "qos_drl"), key=lambda k: others[k])
    return {"avg_qos_mean": {k: round(v, 4) for k, v in means.items()},
            "avg_qos_draws": {k: [round(x, 4) for x in v] for k, v in cells.items()},
            "gain_vs_baseline_rl": gain(means["qos_drl"], means["baseline_rl"]),
            "gain_vs_baseline_rl_draws": draws,
            "gain_vs_best_other": gain(means["qos_drl"], means[best_other]),
            "best_other": best_other,
            "beats_every_baseline": beats_every_baseline({"_": others})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_simulator_arguments(parser)
    parser.add_argument("--seeds", type=int, nargs="+", default=[7, 8, 9, 10, 11, 12])
    parser.add_argument("--trace", type=Path,
                        default=DATASETS / "traces" / "mooncake_conversation.jsonl")
    parser.add_argument("--processes", nargs="+", choices=PROCESSES, default=list(PROCESSES))
    parser.add_argument("--out", type=Path,
                        default=REPO / "docs/results/qos_drl/trace.json")
    parser.set_defaults(rates=[5.0])
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    qos_meta = load_checkpoint(args.checkpoint)[1]
    baseline_meta = load_checkpoint(args.baseline_checkpoint)[1]
    limit_s = qos_meta.get("limit_ms", 30.0) / 1000
    setup = comparison(args.data, args.buckets, qos_meta, baseline_meta, args.bucket_estimate)
    (mapping, cores, solo), specs, heldout, source = setup
    processes = {k: v for k, v in arrival_processes(trace_times(args.trace), args.arrivals)
                 .items() if k in args.processes}
    table: dict[str, dict[str, Any]] = {}
    agents = load_agents(args)
    for process, trace in processes.items():
        for rate in args.rates:
            cells: dict[str, list[float]] = {}
            for seed in args.seeds:
                sim = QosSim(specs, heldout, rate, limit_s, seed=seed, cores=cores, solo=solo,
                             speed=args.speed, trace=trace)
                for name, router in routers(args, agents).items():
                    cells.setdefault(name, []).append(evaluate(sim, router, args.arrivals).avg_qos)
                print(f"{process} λ={rate:g} seed {seed}: " + ", ".join(
                    f"{k} {v[-1]:.3f}" for k, v in cells.items()), flush=True)
            row = summarize(cells)
            row["gap_cv"] = [burstiness(trace, seed, rate) for seed in args.seeds]
            table.setdefault(process, {})[f"{rate:g}"] = row
            print(f"{process} λ={rate:g}: qos_drl vs Baseline RL "
                  f"{percent(row['gain_vs_baseline_rl'])} (draws " + ", ".join(
                      percent(g) for g in row["gain_vs_baseline_rl_draws"])
                  + f"), beats every baseline: {row['beats_every_baseline']}", flush=True)
    write_json(args.out, {
        "table": table, "trace": repo_path(args.trace), "arrivals_per_draw": args.arrivals,
        "seeds": args.seeds, "limit_ms": limit_s * 1000, "speed": args.speed,
        "fleet": mapping, "cores": cores,
        "predictions": source, "checkpoint": repo_path(args.checkpoint),
        "baseline_checkpoint": repo_path(args.baseline_checkpoint),
        "command": " ".join(["python -m bench.studies.qos.trace", *sys.argv[1:]]),
        "commit": git_commit()})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
