"""DiSCo's dispatch tables (Algorithms 2 and 3) from a window of prompt lengths and the
server's TTFT distribution.

Budget b: the share of prompt tokens the constrained side may process, E[I·l] <= b·E[l],
where I says whether the constrained side's leg starts. Both tables come out as step
functions of the prompt length with one boundary length, so a lookup is two
comparisons, and a plan for another b (a per-request override) is a binary search over
arrays prepared once per recompute.

Algorithm 2 (device-constrained): the server starts at t = 0, the device after w(l)
unless a server token has arrived, so the device's leg starts with probability
1 - F(w(l)). Phase 1 sets every w to w_tail = F⁻¹(1 - min(alpha, b)); phase 2 spends the
rest on the shortest prompts (w = 0) and gives the boundary length the partial w* that
spends exactly what is left. Algorithm 2's line 18 as printed solves F(w*)·cost =
remaining, which would make w* grow with the budget left; we solve what the
accounting says: the boundary's extra spend l·p(l)·(F(w_tail) - F(w*)) = remaining.

Algorithm 3 (server-constrained): prompts shorter than l_th run on the device alone,
the rest on both at t = 0, l_th such that the short ones carry (1 - b) of the tokens.
Lengths are discrete, so the boundary length is raced with the probability that makes
the share exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from policies.disco.distributions import Ecdf, Floats

NEVER = math.inf  # a wait after which the device's leg never starts


@dataclass(frozen=True, slots=True)
class WaitTable:
    """Algorithm 2's w(l): 0 below `boundary`, `w_star` at it, `w_tail` above."""

    boundary: float
    w_star: float
    w_tail: float

    def wait(self, prompt_tokens: float) -> float:
        if prompt_tokens < self.boundary:
            return 0.0
        return self.w_star if prompt_tokens == self.boundary else self.w_tail


@dataclass(frozen=True, slots=True)
class RaceTable:
    """Algorithm 3: the probability that a prompt also runs on the server, 0 below
    `threshold` (l_th), `boundary_share` at it, 1 above."""

    threshold: float
    boundary_share: float

    def race_share(self, prompt_tokens: float) -> float:
        if prompt_tokens < self.threshold:
            return 0.0
        return self.boundary_share if prompt_tokens == self.threshold else 1.0


NO_DEVICE = WaitTable(-math.inf, NEVER, NEVER)
NO_SERVER = RaceTable(math.inf, 0.0)


@dataclass(frozen=True, slots=True)
class LengthMass:
    """The distinct prompt lengths and the share of all prompt tokens each carries."""

    lengths: Floats  # ascending, distinct
    mass: Floats  # l·p(l) / E[l], sums to 1
    cumulative: Floats  # running sum of `mass`

    @classmethod
    def of(cls, sorted_lengths: Floats) -> LengthMass | None:
        """None when the window holds no tokens at all."""
        lengths, counts = np.unique(sorted_lengths, return_counts=True)
        tokens = lengths * counts
        total = float(tokens.sum())
        if total <= 0.0:
            return None
        mass = tokens / total
        return cls(lengths, mass, np.cumsum(mass))

    def before(self, k: int) -> float:
        return float(self.cumulative[k - 1]) if k > 0 else 0.0


def device_plan(lengths: LengthMass | None, ttft: Ecdf, tail_ratio: float,
                budget: float) -> WaitTable:
    """Algorithm 2: the wait table spending `budget` of the prompt tokens on the device."""
    if budget <= 0.0 or lengths is None or not len(ttft):
        return NO_DEVICE
    w_tail = ttft.quantile(1.0 - min(tail_ratio, budget))
    s_tail = ttft.survival(w_tail)
    if budget <= tail_ratio:
        return WaitTable(-math.inf, w_tail, w_tail)
    left = budget - s_tail
    if left <= 0.0:  # censoring kept F below 1 - alpha: the tail alone spends it all
        return WaitTable(-math.inf, w_tail, w_tail)
    unit = ttft.survival(0.0) - s_tail  # what w = 0 adds over w_tail per unit of mass
    if unit <= 0.0:
        return WaitTable(math.inf, 0.0, w_tail)
    k = int(np.searchsorted(lengths.cumulative * unit, left + 1e-15, side="right"))
    if k >= len(lengths.lengths):
        return WaitTable(math.inf, 0.0, w_tail)
    remaining = left - lengths.before(k) * unit
    target_survival = s_tail + remaining / float(lengths.mass[k])
    w_star = ttft.quantile(1.0 - target_survival)
    return WaitTable(float(lengths.lengths[k]), w_star, w_tail)


def server_plan(lengths: LengthMass | None, budget: float) -> RaceTable:
    """Algorithm 3: l_th with Σ_{l < l_th} l·p(l) = (1 - budget)·E[l]."""
    if budget <= 0.0 or lengths is None:
        return NO_SERVER
    device_only = 1.0 - min(budget, 1.0)
    k = int(np.searchsorted(lengths.cumulative, device_only + 1e-15, side="right"))
    if k >= len(lengths.lengths):
        return NO_SERVER
    alone = (device_only - lengths.before(k)) / float(lengths.mass[k])
    return RaceTable(float(lengths.lengths[k]), min(1.0, max(0.0, 1.0 - alone)))


def realized_budget(sorted_lengths: Floats, start_probability: Floats) -> float:
    """E[I·l] / E[l] over a sample of lengths, each with its leg's start probability."""
    total = float(sorted_lengths.sum())
    return float((sorted_lengths * start_probability).sum() / total) if total > 0 else 0.0
