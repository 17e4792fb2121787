"""qos_drl's state graph: features, queue caps, masks, Baseline RL's view."""

from __future__ import annotations

import numpy as np
import pytest

from policies.qos_drl.state import (
    COUNT_SCALE,
    QUEUE_CAP,
    TOKEN_SCALE,
    ExpertState,
    RequestFeatures,
    build_state,
)


def req(i: int) -> RequestFeatures:
    return RequestFeatures(prompt_tokens=100 + i, score=0.5, length=300.0, memory=0.01,
                           generated=10 * i, latency_per_token=0.015)


def test_queues_are_capped_at_five_but_counts_are_kept() -> None:
    busy = ExpertState(0.4, 7, 2, tuple(req(i) for i in range(7)), (req(8), req(9)))
    idle = ExpertState(0.0, 0, 0, (), ())
    g = build_state(50, [0.7, 0.2], [400.0, 100.0], [busy, idle], limit=0.03)
    assert g.arrived.tolist() == pytest.approx([0.05, 0.7, 0.2, 0.4, 0.1])
    assert g.experts.shape == (2, 5)
    assert g.experts[0].tolist() == pytest.approx([0.4, 7 / COUNT_SCALE, 2 / COUNT_SCALE, 1, 0])
    assert g.experts[1, 3:].tolist() == [0, 1]  # one-hot id
    assert g.running.shape == (2, QUEUE_CAP, 6)
    assert g.running_mask.tolist() == [[1] * 5, [0] * 5]
    assert g.waiting_mask.tolist() == [[1, 1, 0, 0, 0], [0] * 5]
    first = g.running[0, 0]
    assert first.tolist() == pytest.approx([100 / TOKEN_SCALE, 0.5, 0.3, 0.01, 0.0, 0.5])
    assert not g.running[1].any()


def test_latency_feature_is_relative_to_the_limit_and_clipped() -> None:
    slow = RequestFeatures(10, 0.1, 10.0, 0.0, 1, latency_per_token=5.0)
    g = build_state(1, [0.0], [0.0], [ExpertState(0.0, 1, 0, (slow,), ())], limit=0.03)
    assert g.running[0, 0, 5] == pytest.approx(10.0)


def test_baseline_rl_sees_expert_level_features_only() -> None:
    e = ExpertState(0.25, 3, 1, (req(0),), ())
    g = build_state(10, [0.9, 0.1], [5.0, 5.0], [e, e], limit=0.03)
    flat = g.expert_level()
    assert flat.shape == (6,)
    assert np.allclose(flat, [0.25, 0.3, 0.1] * 2)
