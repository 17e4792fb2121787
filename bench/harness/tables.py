"""Side-by-side Markdown tables of several runs' summaries (one row per run)."""

from __future__ import annotations

from collections.abc import Sequence

from bench.harness.report import Percentiles, Summary


def _ms(values: Percentiles | None) -> str:
    return " / ".join(f"{v * 1000:.0f}" for v in values) if values else "-"


def _s(values: Percentiles | None) -> str:
    return " / ".join(f"{v:.2f}" for v in values) if values else "-"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def latency_table(summaries: Sequence[Summary]) -> str:
    header = ["run", "policy", "requests", "errors", "migrations", "duration s",
              "offered req/s", "req/s", "out tok/s", "TTFT p50/p90/p99 ms",
              "TPOT p50/p90/p99 ms", "E2E p50/p90/p99 s", "QoS"]
    rows = [[s.name, s.policy, str(s.requests), str(s.errors), str(s.migrations),
             f"{s.duration_s:.1f}", _num(s.offered_rps), f"{s.throughput_rps:.2f}",
             f"{s.output_tokens_per_s:.1f}", _ms(s.ttft_s), _ms(s.tpot_s), _s(s.e2e_s),
             _num(s.qos, 3)] for s in summaries]
    return _table(header, rows)


def slo_table(summaries: Sequence[Summary]) -> str:
    """Goodput (req/s) and SLO attainment (%) per SLO scale; empty without solo data."""
    scales = sorted({p.scale for s in summaries for p in s.slo})
    if not scales:
        return ""
    header = ["run", "policy", "with SLO"] + [f"goodput@{x:g}x (att %)" for x in scales]
    rows = []
    for s in summaries:
        by_scale = {p.scale: p for p in s.slo}
        cells = [f"{by_scale[x].goodput_rps:.3f} ({_num(_pct(by_scale[x].attainment), 0)})"
                 if x in by_scale else "-" for x in scales]
        rows.append([s.name, s.policy, str(s.slo_requests), *cells])
    return _table(header, rows)


def _pct(value: float | None) -> float | None:
    return None if value is None else value * 100
