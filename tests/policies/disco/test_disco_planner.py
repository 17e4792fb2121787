"""Algorithms 2 and 3 spend exactly the budget they are given, on synthetic p and F."""

from __future__ import annotations

import math

import numpy as np
import pytest

from policies.disco.distributions import Ecdf, Floats, kaplan_meier
from policies.disco.planner import LengthMass, device_plan, realized_budget, server_plan

BUDGETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0)
ALPHA = 0.05


def lengths(kind: str) -> Floats:
    rng = np.random.default_rng(1)
    draws = (rng.uniform(1, 400, 5000) if kind == "uniform"
             else rng.lognormal(math.log(40), 0.8, 5000))
    return np.sort(np.maximum(1.0, np.round(draws)))


def ttft(kind: str, n: int = 20000, seed: int = 2) -> tuple[Ecdf, Floats]:
    rng = np.random.default_rng(seed)
    draws = (rng.exponential(0.5, n) if kind == "exponential"
             else rng.lognormal(math.log(0.6), 0.9, n))
    return kaplan_meier(draws, np.zeros(n, dtype=bool)), draws


@pytest.mark.parametrize("length_kind", ["uniform", "lognormal"])
@pytest.mark.parametrize("ttft_kind", ["exponential", "lognormal"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_algorithm_2_spends_the_budget(length_kind: str, ttft_kind: str,
                                       budget: float) -> None:
    sample = lengths(length_kind)
    ecdf, _ = ttft(ttft_kind)
    table = device_plan(LengthMass.of(sample), ecdf, ALPHA, budget)
    starts = np.array([ecdf.survival(table.wait(length)) for length in sample])
    assert realized_budget(sample, starts) == pytest.approx(budget, abs=1e-3)
    # the same table against fresh draws of the true F (the planner saw a sample of it)
    fresh = ttft(ttft_kind, seed=9)[1]
    waits = np.array([table.wait(length) for length in sample])
    survival = {w: float((fresh > w).mean()) for w in set(waits.tolist())}
    started = np.array([survival[w] for w in waits.tolist()])
    assert realized_budget(sample, started) == pytest.approx(budget, abs=0.01)

@pytest.mark.parametrize("budget", BUDGETS)
def test_w_tail_is_the_quantile_of_f(budget: float) -> None:
    ecdf, _ = ttft("exponential")
    table = device_plan(LengthMass.of(lengths("uniform")), ecdf, ALPHA, budget)
    tail = min(ALPHA, budget)
    assert table.w_tail == ecdf.quantile(1 - tail)
    assert table.w_tail == pytest.approx(-0.5 * math.log(tail), rel=0.05)  # Exp(mean 0.5)
    assert ecdf.survival(table.w_tail) == pytest.approx(tail, abs=1e-4)


def test_algorithm_2_waits_grow_with_the_prompt_and_shrink_with_the_budget() -> None:
    sample = lengths("lognormal")
    ecdf, _ = ttft("lognormal")
    mass = LengthMass.of(sample)
    tables = [device_plan(mass, ecdf, ALPHA, b) for b in (0.2, 0.4, 0.6)]
    for table in tables:
        waits = [table.wait(length) for length in sample]
        assert waits == sorted(waits)
        assert waits[0] == 0.0 and waits[-1] == table.w_tail
    assert tables[0].boundary < tables[1].boundary < tables[2].boundary


def test_no_budget_never_starts_the_device_and_a_full_one_always_at_once() -> None:
    sample = lengths("uniform")
    ecdf, _ = ttft("exponential")
    assert device_plan(LengthMass.of(sample), ecdf, ALPHA, 0.0).wait(10.0) == math.inf
    assert device_plan(LengthMass.of(sample), ecdf, ALPHA, 1.0).wait(sample[-1]) == 0.0


@pytest.mark.parametrize("length_kind", ["uniform", "lognormal"])
@pytest.mark.parametrize("budget", (0.0, *BUDGETS))
def test_algorithm_3_spends_the_budget(length_kind: str, budget: float) -> None:
    sample = lengths(length_kind)
    table = server_plan(LengthMass.of(sample), budget)
    shares = np.array([table.race_share(length) for length in sample])
    assert realized_budget(sample, shares) == pytest.approx(budget, abs=1e-3)
    # short prompts run on the device alone, long ones are raced
    assert shares[0] == (1.0 if budget == 1.0 else 0.0)
    assert shares[-1] == (0.0 if budget == 0.0 else 1.0)


def test_l_th_splits_the_token_mass() -> None:
    sample = np.arange(1.0, 101.0, dtype=np.float64)  # every length once: Σ_{l < t} l = t(t-1)/2
    table = server_plan(LengthMass.of(sample), 0.5)
    below = sample[sample < table.threshold].sum()
    at = table.threshold * (1 - table.boundary_share)
    assert (below + at) / sample.sum() == pytest.approx(0.5, abs=1e-12)
    assert table.threshold == 71.0  # 70·71/2 = 2485 <= 2525 < 71·72/2
