"""The action impact estimator and rewards of qos_drl (paper Eqs. 1, 13-16)."""

from __future__ import annotations

import pytest

from policies.qos_drl.impact import (
    Coefficients,
    RunningRequest,
    decode_latency,
    fit_slope,
    impact,
    latency_increase,
    prefill_latency,
    qos,
    reward,
)

K = Coefficients(k1=0.001, k2=0.0001)


def running(output: int = 100, generated: int = 40, lpt: float = 0.02, score: float = 0.8,
            prompt: int = 10) -> RunningRequest:
    return RunningRequest(prompt, output, generated, lpt, score)


def test_qos_is_score_only_within_the_limit() -> None:
    assert qos(0.7, 0.030, 0.030) == 0.7
    assert qos(0.7, 0.0301, 0.030) == 0.0


def test_prefill_and_decode_latency_are_eq_13_14() -> None:
    assert prefill_latency(K, 50) == pytest.approx(0.05)
    queue = [running(prompt=10, generated=5), running(prompt=20, generated=15)]
    assert decode_latency(K, queue) == pytest.approx(0.0001 * (15 + 35))


def test_latency_increase_sums_the_overlapping_decode_steps() -> None:
    # i has 60 tokens left, j needs 30: overlap 30; Σ_{k=1}^{30} (p_j + k) = 30·8 + 465
    r = running(output=100, generated=40)
    expected = (0.001 * 8 + 0.0001 * (30 * 8 + 30 * 31 / 2)) / 100
    assert latency_increase(K, r, prompt_tokens=8, output_tokens=30) == pytest.approx(expected)
    # j outlives i: the overlap stops at i's remaining 60 tokens
    longer = (0.001 * 8 + 0.0001 * (60 * 8 + 60 * 61 / 2)) / 100
    assert latency_increase(K, r, prompt_tokens=8, output_tokens=500) == pytest.approx(longer)


def test_impact_counts_only_requests_pushed_over_the_limit() -> None:
    safe = running(lpt=0.001, score=0.9)
    pushed = running(lpt=0.0299, score=0.6)
    already_late = running(lpt=0.05, score=0.5)  # φ = 0 already: nothing to lose
    assert impact(K, [safe, pushed, already_late], 8, 30, limit=0.03) == pytest.approx(0.6)
    assert impact(K, [], 8, 30, limit=0.03) == 0.0


def test_reward_is_completed_qos_minus_impact_and_baseline_ignores_impact() -> None:
    assert reward([0.5, 0.25, 0.0], penalty=0.6) == pytest.approx(0.15)
    assert reward([0.5, 0.25], penalty=0.6, qos_aware=False) == pytest.approx(0.75)
    assert reward([], penalty=0.0) == 0.0


def test_fit_slope_recovers_a_line_and_rejects_one_point() -> None:
    xs = [1.0, 2.0, 4.0, 8.0]
    assert fit_slope(xs, [3 + 0.5 * x for x in xs]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        fit_slope([2.0, 2.0], [1.0, 3.0])
