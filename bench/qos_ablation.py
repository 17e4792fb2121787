"""The paper's ablation (§VI-C, Fig. 17) across training seeds, from `bench.qos_trace` runs.

    python -m bench.qos_ablation --full RUN.json [RUN.json ...] --dsa RUN.json [...]
        [--out docs/results/qos_drl_ablation/ablation.json]

Three agents: Baseline RL (expert-level MLP, completed-QoS reward), "Baseline RL + DSA"
(the HAN state, the same reward: `laneway train qos-drl --reward completed`) and the
full QoS-aware RL (the HAN state and Eq. 16's reward: qos_drl). For each training seed
there is one `bench.qos_trace` run of qos_drl against that seed's Baseline RL
(`--full`) and one of the DSA agent against the same Baseline RL (`--dsa`, in the same
seed order). Every run must share its draws (as `bench.qos_seeds` checks), and each
seed's two runs must score its Baseline RL the same on every draw (checked: the same
checkpoint on the same arrivals). Per arrival process and λ this reports each agent's
mean QoS per seed and over the seeds, and the two steps the paper measures, DSA over
Baseline RL (the paper: +17.27 %) and the QoS-aware reward over DSA (+22.37 %), paired
by seed and of the means.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.bench_qos import git_commit
from bench.qos_live_report import repo_path
from bench.qos_seeds import check_same_draws, draw_setup
from bench.qos_trace import gain, percent
from bench.results import write_json
from predictors.cli import REPO

PAPER = {"dsa_vs_baseline_rl": 0.1727, "qos_aware_vs_dsa": 0.2237}
AGENTS = ("baseline_rl", "dsa", "qos_drl")


def check_same_baselines(full: Sequence[Mapping[str, Any]],
                         dsa: Sequence[Mapping[str, Any]]) -> None:
    """Raise ValueError unless each seed's two runs evaluated the same Baseline RL."""
    if len(full) != len(dsa):
        raise ValueError(f"{len(full)} --full runs against {len(dsa)} --dsa runs")
    for seed, (a, b) in enumerate(zip(full, dsa, strict=True), start=1):
        if a["baseline_checkpoint"] != b["baseline_checkpoint"]:
            raise ValueError(f"run {seed}: Baseline RL {a['baseline_checkpoint']} against "
                             f"{b['baseline_checkpoint']}")
        for process, rates in a["table"].items():
            for rate, row in rates.items():
                if row["avg_qos_draws"]["baseline_rl"] != \
                        b["table"][process][rate]["avg_qos_draws"]["baseline_rl"]:
                    raise ValueError(f"run {seed}: Baseline RL scores differ on {process} "
                                     f"λ = {rate}")


def step(upper: Sequence[float], lower: Sequence[float]) -> dict[str, Any]:
    """One step of the ablation: paired gains per seed and the gain of the means."""
    return {"paired": [gain(u, d) for u, d in zip(upper, lower, strict=True)],
            "of_means": gain(statistics.fmean(upper), statistics.fmean(lower))}


def cell(full: Sequence[Mapping[str, Any]], dsa: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One (process, λ): each agent's mean QoS per seed, their means and the steps."""
    qos = {"baseline_rl": [row["avg_qos_mean"]["baseline_rl"] for row in full],
           "dsa": [row["avg_qos_mean"]["qos_drl"] for row in dsa],
           "qos_drl": [row["avg_qos_mean"]["qos_drl"] for row in full]}
    return {"qos": qos, "mean": {name: statistics.fmean(qos[name]) for name in AGENTS},
            "dsa_vs_baseline_rl": step(qos["dsa"], qos["baseline_rl"]),
            "qos_aware_vs_dsa": step(qos["qos_drl"], qos["dsa"]),
            "qos_drl_vs_baseline_rl": step(qos["qos_drl"], qos["baseline_rl"])}


def summarize(full: Sequence[Mapping[str, Any]],
              dsa: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    check_same_draws([*full, *dsa])
    check_same_baselines(full, dsa)
    return {process: {rate: cell([run["table"][process][rate] for run in full],
                                 [run["table"][process][rate] for run in dsa])
                      for rate in rates}
            for process, rates in full[0]["table"].items()}


def log_line(process: str, rate: str, row: Mapping[str, Any]) -> str:
    means = " / ".join(f"{row['mean'][name]:.3f}" for name in AGENTS)
    steps = ", ".join(
        f"{name} {percent(row[name]['of_means'])} (paired "
        + " ".join(percent(g) for g in row[name]["paired"]) + ")"
        for name in ("dsa_vs_baseline_rl", "qos_aware_vs_dsa", "qos_drl_vs_baseline_rl"))
    return f"{process} λ={rate}: Baseline RL / +DSA / QoS-aware {means}; {steps}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--full", type=Path, nargs="+", required=True,
                        help="bench.qos_trace runs of qos_drl, one per training seed")
    parser.add_argument("--dsa", type=Path, nargs="+", required=True,
                        help="bench.qos_trace runs of the DSA agent, the same seeds in order")
    parser.add_argument("--out", type=Path,
                        default=REPO / "docs/results/qos_drl_ablation/ablation.json")
    args = parser.parse_args(argv)
    full = [orjson.loads(path.read_bytes()) for path in args.full]
    dsa = [orjson.loads(path.read_bytes()) for path in args.dsa]
    try:
        table = summarize(full, dsa)
    except ValueError as error:
        parser.error(str(error))
    for process, rates in table.items():
        for rate, row in rates.items():
            print(log_line(process, rate, row))
    write_json(args.out, {
        "table": table, "paper": PAPER,
        "runs": {"full": [repo_path(p) for p in args.full],
                 "dsa": [repo_path(p) for p in args.dsa]},
        "checkpoints": [{"baseline_rl": a["baseline_checkpoint"], "dsa": b["checkpoint"],
                         "qos_drl": a["checkpoint"]} for a, b in zip(full, dsa, strict=True)],
        **draw_setup(full[0]),
        "command": " ".join(["python -m bench.qos_ablation", *sys.argv[1:]]),
        "commit": git_commit()})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
