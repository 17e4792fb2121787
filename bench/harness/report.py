"""Numbers of one benchmark run: throughput, latency percentiles, SLO goodput, QoS.

* duration: first send → last completion. Throughput counts successful requests.
* TTFT, TPOT, E2E: p50/p90/p99 (linear interpolation) over successful requests.
* SLO at scale s (GoodServe): met iff the request succeeded and e2e ≤ s x its solo
  latency (`bench.harness.solo`). Attainment = met / requests with an SLO (failed requests
  always count, as misses); goodput = met / duration, in requests per second.
* QoS (qos_drl_edge_routing): φ = score x 1[e2e / output_tokens ≤ L], where score is
  the request's quality label for the expert that served it (the final backend,
  named directly or through `expert_map`); failed requests score 0. Reported as the
  mean φ over requests that have a score, or not at all.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.harness.results import RequestResult, RunFile
from bench.harness.solo import DEFAULT_SCALES, SoloLatencies

Percentiles = tuple[float, float, float]  # p50, p90, p99


@dataclass(frozen=True, slots=True)
class QosConfig:
    latency_per_token_s: float = 0.030  # L; the paper's default is 30 ms
    expert_map: Mapping[str, str] = field(default_factory=dict)  # backend → expert

    def score(self, result: RequestResult) -> float | None:
        backend = result.final_backend or ""
        for name in (self.expert_map.get(backend), backend, result.model):
            if name and name in result.quality:
                return result.quality[name]
        return None


@dataclass(frozen=True, slots=True)
class SloPoint:
    scale: float
    attainment: float | None
    goodput_rps: float


@dataclass(frozen=True, slots=True)
class Summary:
    name: str
    policy: str
    requests: int
    errors: int
    migrations: int
    duration_s: float
    offered_rps: float | None
    throughput_rps: float
    output_tokens_per_s: float
    ttft_s: Percentiles | None
    tpot_s: Percentiles | None
    e2e_s: Percentiles | None
    slo_requests: int  # requests with a known SLO (the attainment denominator)
    slo: tuple[SloPoint, ...]
    qos: float | None
    qos_requests: int


def git_commit(short: bool = False) -> str:
    """The commit checked out here: the one a results file's figures come from."""
    args = ["git", "rev-parse", *(["--short"] if short else []), "HEAD"]
    return subprocess.run(args, cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True).stdout.strip()


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0-1) of `values` by nearest rank: an observed value, never an
    interpolation between two."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def percentiles(values: Sequence[float]) -> Percentiles | None:
    if not values:
        return None
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=float), [50, 90, 99])
    return float(p50), float(p90), float(p99)


def duration(results: Sequence[RequestResult]) -> float:
    if not results:
        return 0.0
    return max(r.sent_s + r.e2e_s for r in results) - min(r.sent_s for r in results)


def offered_rate(results: Sequence[RequestResult]) -> float | None:
    """(n - 1) / span of scheduled arrivals: the load the workload offered."""
    arrivals = sorted(r.arrival_s for r in results)
    span = arrivals[-1] - arrivals[0] if arrivals else 0.0
    return (len(arrivals) - 1) / span if span > 0 else None


def meets_slo(result: RequestResult, base: float | None, scale: float) -> bool:
    """The request succeeded within `scale` x its solo latency `base` (None: unknown)."""
    return result.ok and base is not None and result.e2e_s <= scale * base


def slo_points(results: Sequence[RequestResult], solo: SoloLatencies | None,
               scales: Sequence[float], seconds: float) -> tuple[int, tuple[SloPoint, ...]]:
    if solo is None:
        return 0, ()
    bases = [(r, solo.of(r)) for r in results]
    judged = [(r, base) for r, base in bases if base is not None or not r.ok]
    points = []
    for scale in scales:
        met = sum(1 for r, base in judged if meets_slo(r, base, scale))
        points.append(SloPoint(scale, met / len(judged) if judged else None,
                               met / seconds if seconds > 0 else 0.0))
    return len(judged), tuple(points)


def qos(results: Sequence[RequestResult], config: QosConfig) -> tuple[float | None, int]:
    values = []
    for r in results:
        score = config.score(r)
        if score is None:
            continue
        fast = r.ok and bool(r.output_tokens) and \
            r.e2e_s / (r.output_tokens or 1) <= config.latency_per_token_s
        values.append(score if fast else 0.0)
    return (sum(values) / len(values) if values else None), len(values)


def summarize(run: RunFile, solo: SoloLatencies | None = None,
              scales: Sequence[float] = DEFAULT_SCALES, qos_config: QosConfig = QosConfig()
              ) -> Summary:
    results = run.results
    ok = [r for r in results if r.ok]
    seconds = duration(results)
    slo_requests, points = slo_points(results, solo, scales, seconds)
    mean_qos, qos_requests = qos(results, qos_config)
    return Summary(
        run.name, run.policy, len(results), len(results) - len(ok),
        sum(len(r.migrations) for r in results), seconds, offered_rate(results),
        len(ok) / seconds if seconds > 0 else 0.0,
        sum(r.output_tokens or 0 for r in ok) / seconds if seconds > 0 else 0.0,
        percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        percentiles([r.e2e_s for r in ok]),
        slo_requests, points, mean_qos, qos_requests)
