"""Where goodput is won or lost, per GPU tier: one SLO scale of a kept `bench_goodput`
run (`--keep DIR`) broken down by the hardware tier of the backend each request was
first sent to.

    python -m bench.studies.goodput.breakdown DIR/repeat-0 --scale 2 [--out breakdown.json]

Per policy (the baselines' single run, judged at the scale; a goodput variant's run at
that scale) and tier: the share of requests first placed there, how many of those met
their SLO (`bench.harness.report.meets_slo`: e2e <= scale x solo latency), how many were moved
(token-ID migration) and where they ended, how many moves left the tier's instances
and how many of those went to another instance of the same tier; and how evenly the
tier's instances were loaded: each instance's peak number of requests in flight (a
request counts on a backend from its send, or the move onto it, to its end or its next
move), as the mean and the maximum over the tier's instances. A tier is a backend's
`labels.profile` (emulated) or `labels.variant` (real vLLM-CPU), from the run's proxy
config.

`--length-predictor ARTIFACT` adds, per tier, the median of predicted / true answer
length over the requests first placed there that met their SLO and over those that
missed it (the predictor run offline on each prompt as the proxy saw it, the
alpaca_eval instruction looked up by request id in `--shared`; true length = the
request's `max_tokens` in the record): just-enough selection sends the requests
predicted shortest to the slowest tier, so that tier collects the under-predictions.

Where a run kept its proxy log (`<run>.log`, `bench_goodput --keep`, with every
decision logged), a second table says why requests went where: per policy, each
arrival decision and each τ-check move by the kind of reason the policy gave (for
goodput: feasible, feasible after `protect` refused some backends, none feasible,
every backend would be harmed) and the tier it went to (a move: from and to), with how
many of those requests met their SLO in the end.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from bench.harness import results
from bench.harness.cli import slo_base_option
from bench.harness.commands import read_solo
from bench.harness.compare import split_run_name
from bench.harness.plots import inflight_series
from bench.harness.report import meets_slo
from bench.harness.results import RequestResult
from bench.harness.solo import SoloLatencies
from predictors.home import DATASETS


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
    # median predicted / true length of the placed requests that met / missed (None:
    # no predictor given, or no such request)
    met_length_ratio: float | None = None
    missed_length_ratio: float | None = None


@dataclass(frozen=True, slots=True)
class DecisionRow:
    event: str  # "arrival" or "move"
    kind: str  # `reason_kind` of the policy's reason
    source: str  # a move's tier it left ("" for an arrival)
    tier: str  # where the request went
    count: int
    met: int  # of those requests, SLO met in the end


ARRIVAL = re.compile(r"request (\S+) model=\S+ -> (\S+) \((.*); \d+ candidates\)$")
MOVE = re.compile(r"request (\S+): policy moves it (\S+) -> (\S+) after \d+ tokens "
                  r"\((.*)\)$")


def reason_kind(reason: str) -> str:
    """A decision's reason (`proxy.routing.router`'s log line), by the branch of the policy
    that gave it; a τ-check move's by the choice among the faster backends."""
    reason = reason.partition(" here; ")[2] or reason  # a move: "SLO risk: ... here; <choice>"
    if "(protect: all " in reason:
        return "every backend would be harmed"
    if reason.startswith("none feasible"):
        return "none feasible"
    if reason.startswith("just enough"):
        return "feasible" + (" after protect refused some" if "(protect: " in reason else "")
    # another policy's reason, its numbers (loads, block counts) masked
    return re.sub(r"\d+", "N", reason.split(":")[0].split(" (")[0].split(";")[0])


def decisions(log: str, rs: Sequence[RequestResult], tiers: Mapping[str, str],
              solo: SoloLatencies, scale: float) -> list[DecisionRow]:
    """Every decision in a kept proxy log (requests by the load generator's
    `x-request-id`, bench-<seq>-<id>), counted by event, reason kind and tier."""
    by_id = {f"bench-{r.seq}-{r.id}": r for r in rs}
    counts: Counter[tuple[str, str, str, str]] = Counter()
    met: Counter[tuple[str, str, str, str]] = Counter()
    for line in log.splitlines():
        if (arrival := ARRIVAL.search(line)) is not None:
            rid, source, target, reason = arrival[1], "", arrival[2], arrival[3]
            event = "arrival"
        elif (move := MOVE.search(line)) is not None:
            rid, source, target, reason = move[1], tiers.get(move[2], move[2]), move[3], move[4]
            event = "move"
        else:
            continue
        r = by_id.get(rid)
        if r is None:
            continue  # a request the records do not hold (e.g. cut before it was sent)
        key = (event, reason_kind(reason), source, tiers.get(target, target))
        counts[key] += 1
        met[key] += meets_slo(r, solo.of(r), scale)
    return [DecisionRow(*key, count, met[key]) for key, count in sorted(counts.items())]


def decision_table(report: Mapping[str, Sequence[DecisionRow]]) -> str:
    lines = ["| policy | decision | reason | tier (move: from → to) | requests | SLO met |",
             "|---|---|---|---|---:|---:|"]
    for label, rows in report.items():
        for row in rows:
            where = f"{row.source} → {row.tier}" if row.source else row.tier
            lines.append(f"| {label} | {row.event} | {row.kind} | {where} | {row.count} | "
                         f"{row.met / row.count:.0%} |")
    return "\n".join(lines)


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


def median_ratio(rs: Sequence[RequestResult], ratio: Callable[[RequestResult], float] | None
                 ) -> float | None:
    return round(statistics.median(map(ratio, rs)), 3) if ratio is not None and rs else None


def breakdown(rs: Sequence[RequestResult], tiers: Mapping[str, str], solo: SoloLatencies,
              scale: float, length_ratio: Callable[[RequestResult], float] | None = None
              ) -> list[TierRow]:
    """`length_ratio`: a request's predicted / true answer length, for the two ratio
    columns."""
    peaks = peak_inflight(rs)
    moves = [(tiers.get(m.from_backend), tiers.get(m.to_backend))
             for r in rs for m in r.migrations]
    by_tier: dict[str, list[str]] = defaultdict(list)
    for name, tier in tiers.items():
        by_tier[tier].append(name)
    rows = []
    for tier, names in sorted(by_tier.items()):
        placed = [r for r in rs if tiers.get(r.backend or "") == tier]
        met: list[RequestResult] = []
        missed: list[RequestResult] = []
        for r in placed:
            (met if meets_slo(r, solo.of(r), scale) else missed).append(r)
        tier_peaks = [peaks.get(n, 0) for n in names]
        rows.append(TierRow(
            tier, len(names), len(placed), len(met),
            sum(1 for r in placed if r.migrations),
            sum(1 for r in rs if tiers.get(r.final_backend or "") == tier),
            sum(1 for src, _ in moves if src == tier),
            sum(1 for src, dst in moves if src == dst == tier),
            round(statistics.fmean(tier_peaks), 2), max(tier_peaks),
            median_ratio(met, length_ratio), median_ratio(missed, length_ratio)))
    return rows


def length_ratios(artifact: Path, shared: Path, model_map: Mapping[str, str]
                  ) -> Callable[[RequestResult], float]:
    """predicted / true length of a kept alpaca_eval request, by the artifact."""
    from bench.models.lexicon import alpaca_rows
    from bench.studies.goodput.length_cap_leak import predicted_length
    from predictors.length.predictor import load_artifact

    prompts = {f"alpaca-{row['id']}": row["instruction"] for row in alpaca_rows(shared)}
    predictor = load_artifact(artifact, model_map)

    def ratio(r: RequestResult) -> float:
        if r.id not in prompts:
            raise ValueError(f"{r.id}: not an alpaca_eval request (--length-predictor "
                             "reads alpaca_eval workloads only)")
        return predicted_length(predictor, r.model, prompts[r.id]) / r.max_tokens

    return ratio


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
             "moves off (to the same tier) | peak in flight per instance (mean / max) | "
             "predicted / true length, met / missed |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, rows in report.items():
        total = sum(row.placed for row in rows) or 1
        for row in rows:
            met = f"{row.met / row.placed:.0%}" if row.placed else "-"
            moved = f"{row.moved / row.placed:.0%}" if row.placed else "-"
            lines.append(f"| {label} | {row.tier} | {row.instances} | "
                         f"{row.placed / total:.0%} | {met} | {moved} | {row.ended_here} | "
                         f"{row.moves_out} ({row.moves_within}) | "
                         f"{row.peak_inflight_mean:.1f} / {row.peak_inflight_max} | "
                         f"{_ratio(row.met_length_ratio)} / {_ratio(row.missed_length_ratio)} |")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("run_dir", help="a kept repeat directory (bench_goodput --keep)")
    parser.add_argument("--scale", type=float, default=2.0)
    slo_base_option(parser, "; as the run's (bench_goodput --slo-base)")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    parser.add_argument("--length-predictor", default=None, metavar="ARTIFACT",
                        help="add predicted / true length per tier (met / missed)")
    parser.add_argument("--model-map", default="tiny-llama=gpt-3.5-turbo-1106",
                        help="served model=predictor key, comma-separated (as "
                        "bench_goodput's proxy config)")
    parser.add_argument("--shared", default=str(DATASETS))
    args = parser.parse_args(argv)
    directory = Path(args.run_dir)
    if not (directory / "solo.jsonl").exists():
        parser.error(f"no solo.jsonl in {directory}")
    solo = read_solo([str(directory / "solo.jsonl")], args.slo_base)
    assert solo is not None
    try:
        files = run_files(directory, args.scale)
    except ValueError as e:
        parser.error(str(e))
    if not files:
        parser.error(f"no run files in {directory}")
    ratio = None
    if args.length_predictor:
        model_map = dict(pair.split("=", 1) for pair in args.model_map.split(",") if pair)
        ratio = length_ratios(Path(args.length_predictor), Path(args.shared), model_map)
    report, why = {}, {}
    for label, path in files.items():
        tiers = tiers_of(path.with_suffix(".yaml"))
        rs = results.read(path).results
        report[label] = breakdown(rs, tiers, solo, args.scale, ratio)
        log = path.with_suffix(".log")  # the proxy's, kept by bench_goodput --keep
        if log.exists():
            why[label] = decisions(log.read_text(errors="replace"), rs, tiers, solo, args.scale)
    print(table(report, args.scale))
    if why:
        print(f"\nDecisions by reason (the kept proxy logs), SLO scale {args.scale:g}:\n")
        print(decision_table(why))
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"scale": args.scale, "run_dir": str(directory),
             "policies": {k: [asdict(r) for r in v] for k, v in report.items()},
             "decisions": {k: [asdict(r) for r in v] for k, v in why.items()}},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
