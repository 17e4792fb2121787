"""The expert-union decode emulator (bench/studies/eldr/fleet.py)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.studies.eldr.fleet import FleetRequest, StepCost, simulate
from policies import build_policy
from proxy.types import NO_PREDICTION


def test_step_cost_follows_the_papers_expert_scaling() -> None:
    cost = StepCost(per_seq_s=0.0)
    assert cost.seconds(8, 16) / cost.seconds(8, 2) == pytest.approx(4.7, rel=1e-3)


def requests(n: int) -> list[FleetRequest]:
    """Two domains whose requests each use a disjoint half of 8 experts, 1 layer."""
    halves = [np.array([[0.25] * 4 + [0.0] * 4]), np.array([[0.0] * 4 + [0.25] * 4])]
    return [FleetRequest(halves[i % 2], NO_PREDICTION, 20, f"d{i % 2}") for i in range(n)]


def test_every_request_finishes_with_a_positive_tpot() -> None:
    result = simulate(build_policy("round_robin"), requests(40), decoders=4, rate=50.0)
    assert len(result.tpot_s) == 40 and min(result.tpot_s) > 0
    assert 2.0 <= min(result.active_experts) and max(result.active_experts) <= 8.0


def test_mixing_domains_on_a_decoder_costs_more_experts_and_time() -> None:
    rr = simulate(build_policy("round_robin"), requests(200), decoders=2, rate=100.0)
    # round robin over 2 decoders with alternating domains sends each domain to one
    # decoder; random mixes them
    mixed = simulate(build_policy("random"), requests(200), decoders=2, rate=100.0)
    assert np.mean(rr.active_experts) <= 4.0 < np.mean(mixed.active_experts)
    assert np.median(rr.tpot_s) < np.median(mixed.tpot_s)
