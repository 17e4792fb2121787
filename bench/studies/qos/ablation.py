"""The paper's ablation (§VI-C, Fig. 17) across training seeds, from `bench.studies.qos.trace` runs.

    python -m bench.studies.qos.ablation --full RUN.json [RUN.json ...] --dsa RUN.json [...]
        [--out docs/results/qos_drl_ablation/ablation.json]

Three agents: Baseline RL (expert-level MLP, completed-QoS reward), "Baseline RL + DSA"
(the HAN state, the same reward: `python -m bench train qos-drl --reward completed`) and the
full QoS-aware RL (the HAN state and Eq. 16's reward: qos_drl). For each training seed
there is one `bench.studies.qos.trace` run of qos_drl against that seed's Baseline RL
(`--full`) and one of the DSA agent against the same Baseline RL (`--dsa`, in the same
seed order). Every run must share its draws (as `bench.studies.qos.seeds` checks), and each
seed's two runs must score its Baseline RL the same on every draw (checked: the same
checkpoint on the same arrivals). Per arrival process and λ this reports each agent's
mean QoS per seed and over the seeds, and the two steps the paper measures, DSA over
Baseline RL (the paper: +17.27 %) and the QoS-aware reward over DSA (+22.37 %), paired
by seed and of the means. Where the trainer's `curve.json` lies beside each checkpoint
(the runs' `.laneway/policies/...`), it also sets the three agents' learning against
each other as the paper's Fig. 16 does: the held-out evaluations averaged over the
seeds per window of `--window` evaluations (`learning` in the JSON, and a PNG beside it).
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
from bench.studies.qos.seeds import check_same_draws, draw_setup, score_difference
from bench.studies.qos.trace import gain, percent
from predictors.home import REPO

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
        difference = score_difference(a, b, ("baseline_rl",))
        if difference is not None:
            raise ValueError(f"run {seed}: {difference}")


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


def learning(curves: Mapping[str, Sequence[Sequence[float]]], window: int
             ) -> dict[str, list[float]]:
    """Each agent's held-out evaluations (one list per seed, every `eval_every` steps)
    averaged over the seeds, then over windows of `window` evaluations; up to the
    shortest run."""
    shortest = min(len(run) for runs in curves.values() for run in runs)
    return {name: [statistics.fmean(statistics.fmean(run[i:i + window]) for run in runs)
                   for i in range(0, shortest - window + 1, window)]
            for name, runs in curves.items()}


def read_curves(checkpoints: Sequence[Mapping[str, str]]
                ) -> tuple[dict[str, list[list[float]]], int] | None:
    """The trainer's held-out evaluations of every agent and seed, and its `eval_every`,
    from the curve.json beside each checkpoint; None if any is missing."""
    curves: dict[str, list[list[float]]] = {name: [] for name in AGENTS}
    steps: set[int] = set()
    for seed in checkpoints:
        for name in AGENTS:
            path = REPO / Path(seed[name]).parent / "curve.json"
            if not path.exists():
                return None
            curve = orjson.loads(path.read_bytes())
            if len(curve["eval_step"]) < 2:
                return None  # too short a run to compare learning
            curves[name].append(curve["eval_qos"])
            steps.add(curve["eval_step"][1] - curve["eval_step"][0])
    if len(steps) != 1:
        raise ValueError(f"the runs evaluated at different intervals: {sorted(steps)}")
    return curves, steps.pop()


def plot_learning(means: Mapping[str, Sequence[float]], window_steps: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"baseline_rl": "Baseline RL", "dsa": "Baseline RL + DSA",
              "qos_drl": "QoS-aware RL (qos_drl)"}
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in means.items():
        ax.plot([(i + 1) * window_steps for i in range(len(values))], values, marker=".",
                label=labels[name])
    ax.set_xlabel("training steps (decisions)")
    ax.set_ylabel("held-out avg QoS, mean over seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
                        help="bench.studies.qos.trace runs of qos_drl, one per training seed")
    parser.add_argument("--dsa", type=Path, nargs="+", required=True,
                        help="bench.studies.qos.trace runs of the DSA agent, the same seeds in "
                        "order")
    parser.add_argument("--out", type=Path,
                        default=REPO / "docs/results/qos_drl_ablation/ablation.json")
    parser.add_argument("--window", type=int, default=8,
                        help="held-out evaluations per point of the learning curves")
    parser.add_argument("--learning", action=argparse.BooleanOptionalAction, default=True,
                        help="the learning curves (--no-learning: the draws only, e.g. "
                        "for runs of the same agents at another --speed)")
    args = parser.parse_args(argv)
    full = [orjson.loads(path.read_bytes()) for path in args.full]
    dsa = [orjson.loads(path.read_bytes()) for path in args.dsa]
    try:
        table = summarize(full, dsa)  # first: it checks the runs pair up
        checkpoints = [{"baseline_rl": a["baseline_checkpoint"], "dsa": b["checkpoint"],
                        "qos_drl": a["checkpoint"]} for a, b in zip(full, dsa, strict=True)]
        curves = read_curves(checkpoints) if args.learning else None
    except ValueError as error:
        parser.error(str(error))
    for process, rates in table.items():
        for rate, row in rates.items():
            print(log_line(process, rate, row))
    curve_summary = None
    if curves is not None:
        means = learning(curves[0], args.window)
        curve_summary = {"window_steps": args.window * curves[1], "mean_eval_qos": means}
        plot_learning(means, args.window * curves[1], args.out.with_name(
            args.out.stem + "_learning.png"))
        for name, values in means.items():
            print(f"learning, {name}: " + " ".join(f"{v:.3f}" for v in values))
    write_json(args.out, {
        "table": table, "paper": PAPER, "learning": curve_summary,
        "runs": {"full": [repo_path(p) for p in args.full],
                 "dsa": [repo_path(p) for p in args.dsa]},
        "checkpoints": checkpoints,
        **draw_setup(full[0]),
        "command": " ".join(["python -m bench.studies.qos.ablation", *sys.argv[1:]]),
        "commit": git_commit()})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
