"""PNG plots of benchmark runs (matplotlib, Agg backend; imported only to plot)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness.report import Summary
from bench.harness.results import RequestResult, RunFile

UNKNOWN_BACKEND = "(no header)"


def inflight_series(results: Sequence[RequestResult]) -> dict[str, list[tuple[float, int]]]:
    """Per backend, (time, open requests) after every change; a migration moves the
    request to its new backend at the moment the client received the event."""
    changes: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for r in results:
        at, backend = r.sent_s, r.backend or UNKNOWN_BACKEND
        for move in r.migrations:
            changes[backend] += [(at, 1), (r.sent_s + move.at_s, -1)]
            at, backend = r.sent_s + move.at_s, move.to_backend
        changes[backend] += [(at, 1), (r.sent_s + r.e2e_s, -1)]
    series: dict[str, list[tuple[float, int]]] = {}
    for backend, deltas in sorted(changes.items()):
        count, points = 0, []
        for time, delta in sorted(deltas):  # at equal times, ends (-1) before starts
            count += delta
            points.append((time, count))
        series[backend] = points
    return series


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(runs: Sequence[RunFile], attribute: str, label: str, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        values = sorted(getattr(r, attribute) * 1000 for r in run.results
                        if r.ok and getattr(r, attribute) is not None)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))],
                    where="post", label=run.name)
    ax.set(xlabel=f"{label} (ms)", ylabel="CDF", title=f"{label} CDF", ylim=(0, 1.02))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _goodput_vs_scale(summaries: Sequence[Summary], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for s in summaries:
        ax.plot([p.scale for p in s.slo], [p.goodput_rps for p in s.slo], marker="o",
                label=s.name)
    ax.set(xlabel="SLO scale (x solo latency)", ylabel="goodput (req/s)",
           title="goodput vs SLO scale")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _goodput_vs_load(summaries: Sequence[Summary], scale: float, path: Path) -> None:
    plt = _pyplot()
    by_policy: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in summaries:
        point = next((p for p in s.slo if p.scale == scale), None)
        if point is not None and s.offered_rps is not None:
            by_policy[s.policy].append((s.offered_rps, point.goodput_rps))
    fig, ax = plt.subplots(figsize=(7, 4))
    for policy, points in sorted(by_policy.items()):
        points.sort()
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=policy)
    ax.set(xlabel="offered load (req/s)", ylabel=f"goodput at {scale:g}x SLO (req/s)",
           title="goodput vs load")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _backend_load(runs: Sequence[RunFile], path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.6 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        for backend, points in inflight_series(run.results).items():
            ax.step([t for t, _ in points], [n for _, n in points], where="post", label=backend)
        ax.set(title=run.name, xlabel="time since run start (s)", ylabel="open requests")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_plots(runs: Sequence[RunFile], summaries: Sequence[Summary], out_dir: Path,
                load_scale: float = 2.0) -> list[Path]:
    """All plots into `out_dir`; the goodput plots only when solo latencies were given."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "ttft_cdf.png", out_dir / "tpot_cdf.png", out_dir / "backend_load.png"]
    _cdf(runs, "ttft_s", "TTFT", written[0])
    _cdf(runs, "tpot_s", "TPOT", written[1])
    _backend_load(runs, written[2])
    if any(s.slo for s in summaries):
        written += [out_dir / "goodput_vs_slo_scale.png", out_dir / "goodput_vs_load.png"]
        _goodput_vs_scale(summaries, written[3])
        _goodput_vs_load(summaries, load_scale, written[4])
    return written
