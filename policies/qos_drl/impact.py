"""QoS, the action impact estimator and the rewards of qos_drl_edge_routing.txt (§IV-A, §V-C).

    φ_j     = s_j · 1[l_j ≤ L]                                                 (1)
    l_pre   = k1_n · p_j                                                       (13)
    l_dec   = k2_n · Σ_{i ∈ running_n} (p_i + d_{i,t})                         (14)
    l⁺_i    = (k1_n · p_j + k2_n · Σ_{k=1}^{min(d_i - d_{i,t}, d_j)} (p_j + k)) / d_i   (15)
    r_j     = Σ_completed φ_i · 1[l_i ≤ L] - Σ_{i ∈ running_{x_j}} φ_i · 1[l_i,t + l⁺_i ≥ L]  (16)

Drop (x_j = 0) has no impact. For a running request, φ_i in the penalty is its score
while it still meets L (s_i · 1[l_{i,t} ≤ L]): a request already late has nothing
left to lose. Baseline RL's reward is the first term of (16) alone (§VI-A).
Pure functions: the training simulator and the online policy share them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Coefficients:
    """k1 (s per prompt token of a prefill), k2 (s per running-queue token per step)."""

    k1: float
    k2: float


@dataclass(frozen=True, slots=True)
class RunningRequest:
    """A request in an expert's running queue at decision time."""

    prompt_tokens: int  # p_i
    output_tokens: int  # d_i (total)
    generated: int  # d_{i,t}
    latency_per_token: float  # l_{i,t}, seconds
    score: float  # s_i


def qos(score: float, latency_per_token: float, limit: float) -> float:
    """Eq. 1."""
    return score if latency_per_token <= limit else 0.0


def prefill_latency(k: Coefficients, prompt_tokens: int) -> float:
    """Eq. 13."""
    return k.k1 * prompt_tokens


def decode_latency(k: Coefficients, running: Iterable[RunningRequest]) -> float:
    """Eq. 14: one decode step over the running queue."""
    return k.k2 * sum(r.prompt_tokens + r.generated for r in running)


def latency_increase(k: Coefficients, running: RunningRequest, prompt_tokens: int,
                     output_tokens: int) -> float:
    """Eq. 15: l⁺_i of running request i when request j (p_j, d_j) joins its expert."""
    overlap = max(0, min(running.output_tokens - running.generated, output_tokens))
    # Σ_{k=1}^{m} (p_j + k) = m·p_j + m(m+1)/2
    decode = k.k2 * (overlap * prompt_tokens + overlap * (overlap + 1) / 2)
    return (k.k1 * prompt_tokens + decode) / max(1, running.output_tokens)


def impact(k: Coefficients, running: Sequence[RunningRequest], prompt_tokens: int,
           output_tokens: int, limit: float) -> float:
    """Σ_{i ∈ running} φ_i · 1[l̂_i ≥ L], l̂_i = l_{i,t} + l⁺_i: QoS the action may cost."""
    lost = 0.0
    for r in running:
        phi = qos(r.score, r.latency_per_token, limit)
        estimated = r.latency_per_token + latency_increase(k, r, prompt_tokens, output_tokens)
        if estimated >= limit:
            lost += phi
    return lost


def reward(completed_qos: Iterable[float], penalty: float, qos_aware: bool = True) -> float:
    """Eq. 16 (qos_aware) or Baseline RL's reward (completed QoS only).

    `completed_qos`: φ_i of every request completed since the previous decision
    (already 0 for those over L)."""
    gained = float(sum(completed_qos))
    return gained - penalty if qos_aware else gained


def fit_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope (with intercept): the 'gradient' the paper profiles."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    if var == 0:
        raise ValueError("fit_slope needs at least two distinct x")
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
