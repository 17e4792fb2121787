"""The live qos_drl evaluation's figures (`bench.studies.qos.live`): per-run summary in the
simulator's `EvalResult` shape, the JSON result, its markdown table, and the merge into
the simulator's docs/results/qos_drl.json."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.report import git_commit
from bench.studies.qos.evaluate import EvalResult, beats_every_baseline
from bench.studies.qos.live_client import LiveRecord
from predictors.home import REPO

# the policies of a live comparison; others in a run (`bench.studies.qos.live --agent`) are
# further qos_drl checkpoints, shown beside them but no baseline of qos_drl's
POLICIES = ("qos_drl", "baseline_rl", "bert_router", "round_robin", "shortest_queue")


def repo_path(path: Path) -> str:
    """`path` relative to the repository when it is inside it (results name no machine)."""
    return str(path.resolve().relative_to(REPO)) if path.resolve().is_relative_to(REPO) \
        else str(path)


AGENT_DIGESTS = ("checkpoint_sha256", "baseline_checkpoint_sha256")
AGENT_KEYS = ("checkpoint", "baseline_checkpoint", *AGENT_DIGESTS)


def agents_of(checkpoint: Path, baseline: Path) -> dict[str, str]:
    """Which two agents a run used: the checkpoints' paths and the first 16 hex digits of
    their SHA-256 (the path alone outlives a retraining)."""
    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    return {"checkpoint": repo_path(checkpoint), "checkpoint_sha256": digest(checkpoint),
            "baseline_checkpoint": repo_path(baseline),
            "baseline_checkpoint_sha256": digest(baseline)}


def same_agents(recorded: Mapping[str, Any], agents: Mapping[str, str]) -> bool:
    """Whether a result that `recorded` its agents was made with `agents` (agents_of's
    keys): by the checkpoints' digests when `agents` names them (a result that names
    none is of weights no longer known, whatever its paths), else by their paths."""
    if any(key in agents for key in AGENT_DIGESTS):
        return all(recorded.get(key) == agents.get(key) for key in AGENT_DIGESTS)
    return all(recorded.get(key) == agents.get(key)
               for key in ("checkpoint", "baseline_checkpoint"))


def live_keys(name: str) -> tuple[str, str, str]:
    """(gain vs Baseline RL, beats every baseline, the run) keys of live run `name`."""
    return (f"qos_gain_vs_baseline_rl_{name}", f"beats_all_baselines_every_lambda_{name}",
            name)


# what the live runs add to qos_drl.json: the emulated fleet's run under live_keys("live")
# (the qos_gain_vs_baseline_rl), the real fleet's under live_keys("live_real"),
# the arrival draws of bench.studies.qos.live_draws under these
DRAW_KEYS = ("live_draws", "qos_gain_vs_baseline_rl_live_draws_mean")


def carried_over(previous: Mapping[str, Any], agents: Mapping[str, str]) -> dict[str, Any]:
    """The live keys of an earlier qos_drl.json that a simulator re-run with `agents`
    keeps: the emulated fleet's run and its draws only if made with the same two agents
    (runs that name none are of agents no longer known), the real fleet's always (its
    agents are the tiny fleet's own)."""
    kept = {key: previous[key] for key in live_keys("live_real") if key in previous}
    for run, keys in (("live", live_keys("live")), ("live_draws", DRAW_KEYS)):
        if run in previous and same_agents(previous[run], agents):
            kept |= {key: previous[key] for key in keys if key in previous}
        elif run in previous:
            print(f"dropping {run} from the earlier results: made with other agents")
    return kept


GAIN_NOTE = ("qos_gain_vs_baseline_rl is the live run's (make bench STUDY=qos-live, "
             "= qos_gain_vs_baseline_rl_live); the simulator's: qos_gain_vs_baseline_rl_sim")


def summarize(records: Sequence[LiveRecord], n_experts: int, limit_s: float
              ) -> dict[str, Any]:
    """The simulator's EvalResult fields (drops and failures count QoS 0) + error rate."""
    n = len(records)
    lpt = np.array([r.lpt_s for r in records if r.lpt_s is not None])
    lpt_ms = lpt * 1000 if len(lpt) else np.zeros(1)
    result = EvalResult(
        float(np.mean([r.qos for r in records])), sum(r.dropped for r in records) / n,
        float(lpt_ms.mean()), float(np.percentile(lpt_ms, 50)),
        float(np.percentile(lpt_ms, 90)), float(np.percentile(lpt_ms, 99)),
        float((lpt <= limit_s).mean()) if len(lpt) else 0.0, n,
        [sum(r.expert == e for r in records) / n for e in range(n_experts)])
    return asdict(result) | {"error_rate": sum(r.error is not None for r in records) / n}


def report(args: argparse.Namespace, experts: Sequence[str], table: dict[str, Any],
           cap: int | None, hardware: Mapping[str, str]) -> dict[str, Any]:
    rates = sorted(table, key=float)
    ref = f"{args.reference_rate:g}" if args.reference_rate else rates[len(rates) // 2]
    row = table[ref]
    gain = row["qos_drl"]["avg_qos"] / row["baseline_rl"]["avg_qos"] - 1 \
        if "qos_drl" in row and "baseline_rl" in row and row["baseline_rl"]["avg_qos"] > 0 \
        else None
    commit = git_commit()
    fleet = {"kind": args.fleet, "backends": dict(hardware)}
    return {"qos_gain_vs_baseline_rl_live": gain, "reference_lambda": float(ref),
            "experts": list(experts), "fleet": fleet, "limit_ms": args.limit_ms,
            "arrivals_per_run": args.arrivals, "lambdas": [float(r) for r in rates],
            "seed": args.seed, "arrival_process": arrival_process(args),
            "answer_cap_tokens": cap, "policies": list(table[rates[0]]),
            **agents_of(args.checkpoint, args.baseline_checkpoint),
            "avg_qos": {r: {p: v["avg_qos"] for p, v in table[r].items()} for r in rates},
            "table": table,
            "command": " ".join(["python -m bench.studies.qos.live", *sys.argv[1:]]),
            "commit": commit}


def arrival_process(args: argparse.Namespace) -> str:
    """Poisson, or the trace `bench.studies.qos.live --trace` replayed (spread or in bursts)."""
    trace = getattr(args, "trace", None)
    if trace is None:
        return "poisson"
    return f"{repo_path(trace)}, {'in bursts' if args.trace_bursts else 'spread'}"


def beats_all(table: dict[str, dict[str, dict[str, Any]]]) -> bool | None:
    """Whether qos_drl has the highest average QoS of the policies (`POLICIES`) of its row
    at every λ (None: no row to compare)."""
    rows = {rate: {p: r["avg_qos"] for p, r in row.items() if p in POLICIES}
            for rate, row in table.items() if "qos_drl" in row}
    rows = {rate: row for rate, row in rows.items() if len(row) > 1}
    return beats_every_baseline(rows) if rows else None


def merge(path: Path, result: dict[str, Any], name: str = "live") -> None:
    """Add the live keys (`name`: "live" or "live_real") to the simulator's results,
    keeping every existing key; only "live" sets the issue's qos_gain_vs_baseline_rl."""
    data = json.loads(path.read_text()) if path.exists() else {}
    gain_key, beats_key, run_key = live_keys(name)
    data[gain_key] = result["qos_gain_vs_baseline_rl_live"]
    data[beats_key] = beats_all(result["table"])
    if name == "live":
        data["qos_gain_vs_baseline_rl"] = result["qos_gain_vs_baseline_rl_live"]
        if "qos_gain_vs_baseline_rl_note" in data:  # it said the live run was not done
            data["qos_gain_vs_baseline_rl_note"] = GAIN_NOTE
    data[run_key] = {k: result[k] for k in ("reference_lambda", "fleet", "limit_ms",
                                            "arrivals_per_run", "lambdas", "table",
                                            *AGENT_KEYS, "command", "commit")}
    path.write_text(json.dumps(data, indent=1) + "\n")


def markdown(result: dict[str, Any]) -> str:
    short = " / ".join(result["experts"])
    process = result.get("arrival_process") or "poisson"  # older runs: Poisson
    arrivals = ("Poisson arrivals" if process == "poisson"
                else f"arrivals of the trace {process},")
    lines = [f"Live through `laneway serve` ({result['fleet']['kind']} fleet, one backend "
             f"per expert), held-out prompts, L = {result['limit_ms']:g} ms/token, "
             f"{result['arrivals_per_run']} {arrivals} per run (seed "
             f"{result['seed']}). Expert share in the order {short}.\n",
             "| λ | policy | avg QoS | drop | errors | lpt p50 ms | lpt p90 ms | within L "
             "| expert share |", "|---|---|---|---|---|---|---|---|---|"]
    for rate, row in result["table"].items():
        for name, r in row.items():
            share = " / ".join(f"{s:.0%}" for s in r["expert_share"])
            lines.append(f"| {rate} | {name} | {r['avg_qos']:.3f} | {r['drop_rate']:.1%} | "
                         f"{r['error_rate']:.1%} | {r['lpt_p50_ms']:.1f} | "
                         f"{r['lpt_p90_ms']:.1f} | {r['within_limit']:.1%} | {share} |")
    gain = result["qos_gain_vs_baseline_rl_live"]
    lines.append(f"\nqos_drl vs Baseline RL at λ={result['reference_lambda']:g}: "
                 + (f"{gain:+.1%}" if gain is not None else "n/a"))
    return "\n".join(lines) + "\n"
