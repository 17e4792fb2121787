"""Where goodput is won or lost, per GPU tier: one SLO scale of a kept `bench_goodput`
run (`--keep DIR`) broken down by the hardware tier of the backend each request was
first sent to.

    python -m bench.goodput_breakdown DIR/repeat-0 --scale 2 [--out breakdown.json]

Per policy (the baselines' single run, judged at the scale; a goodput variant's run at
that scale) and tier: the share of requests first placed there, how many of those met
their SLO (`bench.report.meets_slo`: e2e <= scale x solo latency), how many were moved
(token-ID migration) and where they ended, how many moves left the tier's instances
and how many of those went to another instance of the same tier; and how evenly the
tier's instances were loaded: each instance's peak number of requests in flight (a
request counts on a backend from its send, or the move onto it, to its end or its next
move), as the mean and the maximum over the tier's instances. A tier is a backend's
`labels.profile` (emulated) or `labels.variant` (real vLLM-CPU), from the run's proxy
config.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from bench import results
from bench.commands import read_solo
from bench.compare import split_run_name
from bench.plots import inflight_series
from bench.report import meets_slo
from bench.results import RequestResult
from bench.solo import SoloLatencies


@dataclass(frozen=True, slots=True)
class TierRow:
    tier: str
    instances: int
    placed: int  # requests first sent to this tier
    met: int  # of those, SLO met
    moved: int  # of those, moved at least once
    ended_here: int  # requests (from any tier) that finished on this tier
    moves_out: int  # migrations off this tier's instances (any request, any leg)
    moves_within: int  # of those, onto another instance of the same tier
    peak_inflight_mean: float  # per instance of the tier, its peak in flight; the mean
    peak_inflight_max: int


def tiers_of(config: Path) -> dict[str, str]:
    """backend name -> tier, from a proxy config's `labels`."""
    backends = yaml.safe_load(config.read_text())["backends"]
    out = {}
    for b in backends:
        labels = b.get("labels") or {}
        out[b["name"]] = str(labels.get("profile") or labels.get("variant") or b["name"])
    return out


def peak_inflight(rs: Sequence[RequestResult]) -> Counter[str]:
    """Per backend, the most requests it had in flight at once (`plots.inflight_series`:
    a moved request counts on each backend for its own leg)."""
    return Counter({backend: max(count for _, count in points)
                    for backend, points in inflight_series(rs).items()})


def breakdown(rs: Sequence[RequestResult], tiers: Mapping[str, str], solo: SoloLatencies,
              scale: float) -> list[TierRow]:
    peaks = peak_inflight(rs)
    moves = [(tiers.get(m.from_backend), tiers.get(m.to_backend))
             for r in rs for m in r.migrations]
    by_tier: dict[str, list[str]] = defaultdict(list)
    for name, tier in tiers.items():
        by_tier[tier].append(name)
    rows = []
    for tier, names in sorted(by_tier.items()):
        placed = [r for r in rs if tiers.get(r.backend or "") == tier]
        tier_peaks = [peaks.get(n, 0) for n in names]
        rows.append(TierRow(
            tier, len(names), len(placed),
            sum(meets_slo(r, solo.of(r), scale) for r in placed),
            sum(1 for r in placed if r.migrations),
            sum(1 for r in rs if tiers.get(r.final_backend or "") == tier),
            sum(1 for src, _ in moves if src == tier),
            sum(1 for src, dst in moves if src == dst == tier),
            round(statistics.fmean(tier_peaks), 2), max(tier_peaks)))
    return rows


def run_files(directory: Path, scale: float) -> dict[str, Path]:
    """label -> the run judged at `scale`: a baseline's single run, a variant's @scale
    (ValueError if a variant ran at other scales only)."""
    out, scales = {}, defaultdict(list)
    for path in sorted(directory.glob("*.jsonl")):
        if path.stem == "solo":
            continue
        label, at = split_run_name(path.stem)
        if at is not None:
            scales[label].append(at)
        if at is None or at == scale:
            out[label] = path
    missing = [f"{label} (ran at {', '.join(f'{s:g}' for s in sorted(ran))})"
               for label, ran in scales.items() if label not in out]
    if missing:
        raise ValueError(f"no run at scale {scale:g} of {'; '.join(missing)}")
    return out


def table(report: Mapping[str, Sequence[TierRow]], scale: float) -> str:
    lines = [f"SLO scale {scale:g}; tiers by first placement.", "",
             "| policy | tier | instances | placed | SLO met | moved | ended here | "
             "moves off (to the same tier) | peak in flight per instance (mean / max) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, rows in report.items():
        total = sum(row.placed for row in rows) or 1
        for row in rows:
            met = f"{row.met / row.placed:.0%}" if row.placed else "-"
            moved = f"{row.moved / row.placed:.0%}" if row.placed else "-"
            lines.append(f"| {label} | {row.tier} | {row.instances} | "
                         f"{row.placed / total:.0%} | {met} | {moved} | {row.ended_here} | "
                         f"{row.moves_out} ({row.moves_within}) | "
                         f"{row.peak_inflight_mean:.1f} / {row.peak_inflight_max} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("run_dir", help="a kept repeat directory (bench_goodput --keep)")
    parser.add_argument("--scale", type=float, default=2.0)
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    directory = Path(args.run_dir)
    if not (directory / "solo.jsonl").exists():
        parser.error(f"no solo.jsonl in {directory}")
    solo = read_solo([str(directory / "solo.jsonl")])
    assert solo is not None
    try:
        files = run_files(directory, args.scale)
    except ValueError as e:
        parser.error(str(e))
    if not files:
        parser.error(f"no run files in {directory}")
    report = {}
    for label, path in files.items():
        tiers = tiers_of(path.with_suffix(".yaml"))
        report[label] = breakdown(results.read(path).results, tiers, solo, args.scale)
    print(table(report, args.scale))
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"scale": args.scale, "run_dir": str(directory),
             "policies": {k: [asdict(r) for r in v] for k, v in report.items()}},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
