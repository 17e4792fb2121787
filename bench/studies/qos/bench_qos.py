"""`make bench STUDY=qos`: qos_drl vs the paper's baselines (issue 8, points 6-8).

(a) Simulator (bench/studies/qos/sim.py: emulator engines, held-out prompts): average QoS,
drop rate and latency per token of qos_drl, Baseline RL, BERT router, round robin and
shortest queue first at several λ, the same arrivals for every policy. Decision
latency of `qos_drl` as the proxy runs it (bench/studies/qos/latency.py). Writes
docs/results/qos_drl.json, qos_drl.md and qos_drl/*.png.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.harness.report import git_commit
from bench.harness.results import write_json
from bench.studies.qos import latency as qos_latency
from bench.studies.qos.evaluate import (
    EvalResult,
    Router,
    agent_router,
    beats_every_baseline,
    bert_router,
    evaluate,
    round_robin,
    shortest_queue,
)
from bench.studies.qos.live_report import GAIN_NOTE, agents_of, carried_over, repo_path
from bench.studies.qos.setup import comparison
from bench.studies.qos.sim import QosSim
from bench.studies.qos.train import add_agent_arguments
from policies.qos_drl.sac import SacAgent, load_checkpoint
from predictors.base import BUCKET_ESTIMATES
from predictors.buckets.cli import distilled_artifact
from predictors.home import ALPACA_EVAL, REPO

RESULTS = REPO / "docs" / "results"


def load_agents(args: argparse.Namespace) -> tuple[SacAgent, SacAgent]:
    """qos_drl's and Baseline RL's agents, loaded once for every draw of a run."""
    return load_checkpoint(args.checkpoint)[0], load_checkpoint(args.baseline_checkpoint)[0]


def routers(args: argparse.Namespace, agents: tuple[SacAgent, SacAgent]
            ) -> dict[str, Router]:
    """Every router of a comparison, fresh for one draw: the routers with state (round
    robin's turn, the BERT router's ties, the sampled actor's generator) start anew;
    the greedy agents, which keep none, are `agents`."""
    import torch

    qos_agent, baseline_agent = agents
    torch.manual_seed(args.seed)
    # qos_drl_sampled: the same actor sampling its softmax (a diagnostic row; the policy
    # and every comparison use the greedy action)
    return {"qos_drl": agent_router(qos_agent), "qos_drl_sampled": agent_router(qos_agent, False),
            "baseline_rl": agent_router(baseline_agent),
            "bert_router": bert_router(args.seed), "round_robin": round_robin(),
            "shortest_queue": shortest_queue}


def add_simulator_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompts, predictions, agents, λs and arrivals of a simulator comparison."""
    parser.add_argument("--data", type=Path, default=ALPACA_EVAL)
    parser.add_argument("--buckets", type=Path, default=distilled_artifact())
    add_agent_arguments(parser)
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0, 5.0, 8.0])
    parser.add_argument("--arrivals", type=int, default=600)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--bucket-estimate", choices=BUCKET_ESTIMATES, default=None,
                        help="the value read from each predicted bucket distribution "
                        "(default: the one qos_drl's checkpoint was trained on)")
    parser.add_argument("--speed", type=float, default=1.0,
                        help="every engine step lasts this many times the fitted model's "
                        "(> 1: a machine slower than the fit, < 1: faster; live runs found "
                        "both; how near L each router runs)")


def run_simulator(args: argparse.Namespace, qos_meta: dict[str, Any],
                  baseline_meta: dict[str, Any], only: Sequence[str] | None = None
                  ) -> dict[str, Any]:
    """Every router (or those in `only`) on the fleet qos_drl's checkpoint was trained
    on; on `args.cores` shared cores instead of the checkpoint's when given."""
    setup = comparison(args.data, args.buckets, qos_meta, baseline_meta, args.bucket_estimate)
    (mapping, cores, solo), specs, heldout, source = setup
    cores = args.cores if args.cores is not None else cores
    table: dict[str, dict[str, Any]] = {}
    agents = load_agents(args)
    for rate in args.rates:
        sim = QosSim(specs, heldout, rate, args.limit_ms / 1000, seed=args.seed, cores=cores,
                     solo=solo, speed=args.speed)
        row: dict[str, Any] = {}
        for name, router in routers(args, agents).items():
            if only is not None and name not in only:
                continue
            result: EvalResult = evaluate(sim, router, args.arrivals)
            row[name] = asdict(result)
            print(f"λ={rate:g} {name:15s} QoS {result.avg_qos:.3f} drop "
                  f"{result.drop_rate:.1%} lpt p50 {result.lpt_p50_ms:.1f} ms", flush=True)
        table[f"{rate:g}"] = row
    return {"predictions": {"source": source}, "fleet": mapping, "cores": cores,
            "solo_slowdown": solo, "speed": args.speed, "table": table}


def fit_cores(args: argparse.Namespace, qos_meta: dict[str, Any],
              baseline_meta: dict[str, Any]) -> dict[str, Any]:
    """How far the simulator's average QoS per (policy, λ) is from a live run's
    (`bench.studies.qos.live`'s JSON, `args.live`) on each of `args.fit_cores` shared cores: the
    RMS over the live run's cells, and the share that fits best (what TINY_CORES was set
    from). The live run's λs, policies and arrivals (its first N: a run of N arrivals
    from a fresh fleet, as live, not the first N of a longer run, whose later arrivals
    slow the earlier ones); the same agents as the live run should be."""
    live = json.loads(args.live.read_text())
    args.rates = [float(rate) for rate in live["avg_qos"]]
    args.arrivals = int(live["arrivals_per_run"])
    fits: dict[str, Any] = {}
    for cores in args.fit_cores:
        args.cores = cores
        table = run_simulator(args, qos_meta, baseline_meta, live["policies"])["table"]
        simulated = {rate: {name: r["avg_qos"] for name, r in row.items()}
                     for rate, row in table.items()}
        fits[f"{cores:g}"] = {"rms": qos_rms(simulated, live["avg_qos"]), "avg_qos": simulated}
        print(f"{cores:g} cores: RMS {fits[f'{cores:g}']['rms']:.3f}", flush=True)
    return {"live": repo_path(args.live), "live_commit": live.get("commit"),
            "checkpoint": repo_path(args.checkpoint),
            "baseline_checkpoint": repo_path(args.baseline_checkpoint),
            "arrivals_per_run": args.arrivals,
            "best_cores": float(min(fits, key=lambda c: fits[c]["rms"])), "fits": fits,
            "command": " ".join(["python -m bench.studies.qos.bench_qos", *sys.argv[1:]]),
            "commit": git_commit()}


def qos_rms(simulated: Mapping[str, Mapping[str, float]],
            live: Mapping[str, Mapping[str, float]]) -> float:
    """{λ: {policy: avg QoS}}: the RMS difference over the live run's cells (each must
    be simulated)."""
    errors = [simulated[rate][name] - qos for rate, row in live.items()
              for name, qos in row.items()]
    return math.sqrt(sum(e * e for e in errors) / len(errors))


BUCKET_KEYS = ("top1_score", "top3_score", "top1_length", "top3_length")


def bucket_accuracy(results: Path, artifact: Path) -> dict[str, float]:
    """Held-out accuracy of `artifact` from `laneway evaluate buckets`' results, if they
    are of this very artifact (same version); else nothing (not evaluated)."""
    if not results.exists() or not (artifact / "meta.json").exists():
        return {}
    evaluated = json.loads(results.read_text())
    version = json.loads((artifact / "meta.json").read_text()).get("version")
    if evaluated.get("artifact_version") != version:
        return {}
    return {key: evaluated["methods"]["minilm"][key] for key in BUCKET_KEYS}


def total_steps(checkpoint: Path) -> int | None:
    """The training run's decisions (its last checkpoint), not the best checkpoint's."""
    last = checkpoint.parent / "last.pt"
    return load_checkpoint(last)[1].get("steps") if last.exists() else None


def summary(args: argparse.Namespace, sim: dict[str, Any], latency: dict[str, float],
            qos_meta: dict[str, Any], baseline_meta: dict[str, Any]) -> dict[str, Any]:
    table = sim["table"]
    qos_at = {rate: {name: row[name]["avg_qos"] for name in row} for rate, row in table.items()}
    beats = beats_every_baseline(qos_at)
    ref = f"{args.reference_rate:g}"
    gain = qos_at[ref]["qos_drl"] / qos_at[ref]["baseline_rl"] - 1 \
        if qos_at[ref]["baseline_rl"] > 0 else None
    buckets = bucket_accuracy(args.bucket_results, args.buckets)
    return {
        "qos_gain_vs_baseline_rl": None,
        "qos_gain_vs_baseline_rl_note": GAIN_NOTE,
        "qos_gain_vs_baseline_rl_sim": gain, "qos_gain_reference_lambda": args.reference_rate,
        "beats_all_baselines_every_lambda": beats,
        **{f"bucket_{key}": buckets.get(key) for key in BUCKET_KEYS},
        "bucket_results": repo_path(args.bucket_results) if buckets else None,
        **latency, "training_steps": total_steps(args.checkpoint),
        "checkpoint_steps": qos_meta.get("steps"),
        "baseline_rl_training_steps": total_steps(args.baseline_checkpoint),
        "baseline_rl_checkpoint_steps": baseline_meta.get("steps"),
        "training": qos_meta, "limit_ms": args.limit_ms, "arrivals_per_run": args.arrivals,
        "lambdas": args.rates, "avg_qos": qos_at, "simulator": sim,
        "agents": agents_of(args.checkpoint, args.baseline_checkpoint),
        "command": " ".join(["python -m bench.studies.qos.bench_qos", *sys.argv[1:]]),
        "commit": git_commit(),
    }


def markdown(result: dict[str, Any]) -> str:
    names = ["qos_drl", "qos_drl_sampled", "baseline_rl", "bert_router", "round_robin",
             "shortest_queue"]
    lines = [f"Simulator, held-out prompts, L = {result['limit_ms']:g} ms/token, "
             f"{result['arrivals_per_run']} arrivals per run; qos_drl trained "
             f"{result['training_steps']} steps (best checkpoint at "
             f"{result['checkpoint_steps']}), Baseline RL "
             f"{result['baseline_rl_training_steps']} (best at "
             f"{result['baseline_rl_checkpoint_steps']}).",
             f"Fleet: {fleet_line(result['simulator'])}.\n",
             "| λ | policy | avg QoS | drop | lpt p50 ms | lpt p90 ms | within L |",
             "|---|---|---|---|---|---|---|"]
    for rate, row in result["simulator"]["table"].items():
        for name in names:
            r = row[name]
            lines.append(f"| {rate} | {name} | {r['avg_qos']:.3f} | {r['drop_rate']:.1%} | "
                         f"{r['lpt_p50_ms']:.1f} | {r['lpt_p90_ms']:.1f} | "
                         f"{r['within_limit']:.1%} |")
    gain = result["qos_gain_vs_baseline_rl_sim"]
    lines.append(f"\nqos_drl vs Baseline RL at λ={result['qos_gain_reference_lambda']:g}: "
                 f"{gain:+.1%}" if gain is not None else "\nBaseline RL QoS is 0")
    lines.append(f"Beats every baseline at every λ: {result['beats_all_baselines_every_lambda']}")
    lines.append(qos_latency.markdown(result))
    return "\n".join(lines) + "\n"


def fleet_line(sim: dict[str, Any]) -> str:
    mapping = sim.get("fleet") or {}
    shared = f"; the experts share {sim['cores']} CPU cores" if sim.get("cores") else ""
    if (sim.get("solo_slowdown") or 1.0) != 1.0:
        shared += f", one busy alone runs {sim['solo_slowdown']} times slower than its profile"
    return ", ".join(f"{expert} on {profile}" for expert, profile in mapping.items()) + shared


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    table = result["simulator"]["table"]
    rates = list(table)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in table[rates[0]]:
        left.plot([float(r) for r in rates], [table[r][name]["avg_qos"] for r in rates],
                  marker="o", label=name)
        right.plot([float(r) for r in rates], [table[r][name]["lpt_p50_ms"] for r in rates],
                   marker="o", label=name)
    left.set_xlabel("λ (requests/s)")
    left.set_ylabel("average QoS")
    right.set_xlabel("λ (requests/s)")
    right.set_ylabel("latency per token p50 (ms)")
    right.axhline(result["limit_ms"], color="grey", ls="--", lw=0.8)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "qos_vs_lambda.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_simulator_arguments(parser)
    parser.add_argument("--bucket-results", type=Path,
                        default=RESULTS / "bucket_predictor_distilled.json",
                        help="`laneway evaluate buckets` output; its accuracy is reported "
                        "only if it is of the --buckets artifact")
    parser.add_argument("--reference-rate", type=float, default=5.0)
    parser.add_argument("--limit-ms", type=float,
                        help="L (default: the one qos_drl's checkpoint was trained with)")
    parser.add_argument("--cores", type=float, default=None,
                        help="the experts share this many CPU cores in the simulator "
                        "(default: as the checkpoints were trained, their `cores`)")
    parser.add_argument("--fit-cores", type=float, nargs="+", metavar="C",
                        help="only compare the simulator on each C shared cores with the "
                        "live run --live (RMS of average QoS per policy and λ) → --fit-out")
    parser.add_argument("--live", type=Path, default=RESULTS / "qos_live_real.json")
    parser.add_argument("--fit-out", type=Path, default=RESULTS / "qos_cores_fit.json")
    qos_latency.add_runtime_argument(parser)  # the encoder's, for the decision latency
    parser.add_argument("--out", type=Path, default=RESULTS / "qos_drl.json")
    args = parser.parse_args(argv)
    qos_meta = load_checkpoint(args.checkpoint)[1]  # its fleet, L and training figures
    baseline_meta = load_checkpoint(args.baseline_checkpoint)[1]
    args.limit_ms = args.limit_ms or qos_meta.get("limit_ms", 30.0)
    import torch

    torch.set_num_threads(1)  # one small graph per decision: more threads only contend
    if args.fit_cores:
        fitted = fit_cores(args, qos_meta, baseline_meta)
        args.fit_out.write_text(json.dumps(fitted, indent=1) + "\n")
        print(f"best fit: {fitted['best_cores']:g} cores; wrote {args.fit_out}")
        return 0
    sim = run_simulator(args, qos_meta, baseline_meta)
    latency = qos_latency.measure(
        qos_latency.heldout_prompts(args.data, 160), args.checkpoint, args.buckets,
        args.runtime, qos_latency.RATES, args.reference_rate)
    result = summary(args, sim, latency, qos_meta, baseline_meta)
    if args.out.exists():  # the live runs' keys (bench.studies.qos.live) of these agents survive
        result |= carried_over(json.loads(args.out.read_text()), result["agents"])
        result["qos_gain_vs_baseline_rl"] = result.get("qos_gain_vs_baseline_rl_live")
    write_json(args.out, result)
    args.out.with_suffix(".md").write_text(markdown(result))
    plot(result, args.out.with_suffix(""))
    for run in (args.checkpoint.parent, args.baseline_checkpoint.parent):
        for name in ("learning_curve.png", "curve.json"):  # the trainer's, kept with results
            if (run / name).exists():
                shutil.copy(run / name, args.out.with_suffix("") / f"{run.name}-{name}")
    print(markdown(result), f"wrote {args.out}", sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
