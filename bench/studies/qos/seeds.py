"""qos_drl's gain over Baseline RL across training seeds, from `bench.studies.qos.trace` runs.

    python -m bench.studies.qos.seeds RUN.json [RUN.json ...]
        [--out docs/results/qos_drl_rerun/seeds.json]

Each RUN is one `bench.studies.qos.trace` output for one training seed's pair (qos_drl and
Baseline RL trained with the same `--seed`). The runs must share their draws (seeds,
arrivals, trace, fleet, L, predictions, speed), and the routers that do not learn must score
the same on every draw in every run (checked): then any qos_drl run can be set against
any Baseline RL run on the same draws. Per arrival process and λ this reports each
agent run's average QoS, the paired gains (seed s against seed s), every cross pair
(each qos_drl run against each Baseline RL run), and how often a pair reaches the
issue's +30 %. A gain is of the means over the draws, as in `bench.studies.qos.trace`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.harness.report import git_commit
from bench.harness.results import write_json
from bench.studies.qos.live_report import repo_path
from bench.studies.qos.trace import gain, percent
from predictors.home import REPO

SHARED_KEYS = ("seeds", "arrivals_per_draw", "trace", "fleet", "limit_ms", "predictions")
FIXED_ROUTERS = ("bert_router", "round_robin", "shortest_queue")
TARGET = 0.30  # issue 8: ≥ 30 % over Baseline RL


def draw_setup(run: Mapping[str, Any]) -> dict[str, Any]:
    """What a run's draws depend on (runs before `bench.studies.qos.trace --speed`: the fit, 1)."""
    return {**{key: run[key] for key in SHARED_KEYS}, "speed": float(run.get("speed", 1.0))}


def score_difference(a: Mapping[str, Any], b: Mapping[str, Any], names: Sequence[str]
                     ) -> str | None:
    """Where run `b` lacks a (process, λ) cell of run `a` or scores one of the routers
    `names` differently on some draw of it, said in a few words; None where they agree."""
    for process, rates in a["table"].items():
        for rate, row in rates.items():
            other = b["table"].get(process, {}).get(rate)
            if other is None:
                return f"a run lacks {process} at λ = {rate}"
            for name in names:
                if other["avg_qos_draws"][name] != row["avg_qos_draws"][name]:
                    return f"{name} scores differ on {process} λ = {rate}"
    return None


def check_same_draws(runs: Sequence[Mapping[str, Any]]) -> None:
    """Raise ValueError unless every run evaluated the same draws."""
    first = runs[0]
    expected = draw_setup(first)
    for run in runs[1:]:
        for key, value in draw_setup(run).items():
            if value != expected[key]:
                raise ValueError(f"runs differ in {key}: {expected[key]!r} vs {value!r}")
        difference = score_difference(first, run, FIXED_ROUTERS)
        if difference is not None:
            raise ValueError(f"{difference}: not the same draws")


def cell(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One (process, λ) over the runs: each agent run's mean QoS and every pair's gain."""
    qos = [row["avg_qos_mean"]["qos_drl"] for row in rows]
    baseline = [row["avg_qos_mean"]["baseline_rl"] for row in rows]
    cross = [[gain(q, b) for b in baseline] for q in qos]
    flat = [g for line in cross for g in line if g is not None]
    return {
        "qos_drl": qos, "baseline_rl": baseline,
        "paired_gain": [cross[i][i] for i in range(len(rows))],
        "cross_gain": cross,  # [qos_drl run][Baseline RL run]
        "cross_gain_median": statistics.median(flat),
        "cross_gain_min": min(flat), "cross_gain_max": max(flat),
        "cross_pairs_at_target": sum(g >= TARGET for g in flat), "cross_pairs": len(flat),
        "gain_of_mean_runs": gain(statistics.fmean(qos), statistics.fmean(baseline)),
        "qos_drl_spread": max(qos) - min(qos), "baseline_rl_spread": max(baseline) - min(baseline),
        "best_fixed_router": max(max(row["avg_qos_mean"][n] for n in FIXED_ROUTERS)
                                 for row in rows)}


def summarize_runs(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    check_same_draws(runs)
    return {process: {rate: cell([run["table"][process][rate] for run in runs])
                      for rate in rates}
            for process, rates in runs[0]["table"].items()}


def log_line(process: str, rate: str, row: Mapping[str, Any]) -> str:
    return (f"{process} λ={rate}: qos_drl " + " ".join(f"{q:.3f}" for q in row["qos_drl"])
            + " | Baseline RL " + " ".join(f"{b:.3f}" for b in row["baseline_rl"])
            + " | paired " + " ".join(percent(g) for g in row["paired_gain"])
            + f" | cross median {percent(row['cross_gain_median'])} "
            f"({percent(row['cross_gain_min'])} to {percent(row['cross_gain_max'])}), "
            f"{row['cross_pairs_at_target']}/{row['cross_pairs']} pairs ≥ {TARGET:.0%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="bench.studies.qos.trace outputs")
    parser.add_argument("--out", type=Path,
                        default=REPO / "docs/results/qos_drl_rerun/seeds.json")
    args = parser.parse_args(argv)
    runs = [orjson.loads(path.read_bytes()) for path in args.runs]
    table = summarize_runs(runs)
    for process, rates in table.items():
        for rate, row in rates.items():
            print(log_line(process, rate, row))
    write_json(args.out, {
        "table": table, "runs": [repo_path(path) for path in args.runs],
        "checkpoints": [[run["checkpoint"], run["baseline_checkpoint"]] for run in runs],
        **draw_setup(runs[0]),
        "command": " ".join(["python -m bench.studies.qos.seeds", *sys.argv[1:]]),
        "commit": git_commit()})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
