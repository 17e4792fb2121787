from typing import Any

import pytest

from bench.studies.qos.seeds import summarize_runs


def run(qos_drl: float, baseline_rl: float, bert: float = 0.2, seeds: list[int] | None = None
        ) -> dict[str, Any]:
    fixed = {"bert_router": [bert], "round_robin": [0.1], "shortest_queue": [0.1]}
    row = {"avg_qos_mean": {"qos_drl": qos_drl, "baseline_rl": baseline_rl, "bert_router": bert,
                            "round_robin": 0.1, "shortest_queue": 0.1},
           "avg_qos_draws": {"qos_drl": [qos_drl], "baseline_rl": [baseline_rl], **fixed}}
    return {"table": {"poisson": {"5": row}}, "seeds": seeds or [7], "arrivals_per_draw": 600,
            "trace": "t", "fleet": {}, "limit_ms": 30.0, "predictions": "p"}


def test_every_qos_drl_run_is_set_against_every_baseline_rl_run() -> None:
    row = summarize_runs([run(0.4, 0.3), run(0.36, 0.4)])["poisson"]["5"]
    assert row["paired_gain"] == pytest.approx([0.4 / 0.3 - 1, 0.36 / 0.4 - 1])
    assert [g for line in row["cross_gain"] for g in line] == pytest.approx(
        [0.4 / 0.3 - 1, 0.0, 0.2, 0.36 / 0.4 - 1])  # [qos_drl run][Baseline RL run]
    assert row["cross_gain_max"] == pytest.approx(1 / 3)
    assert row["cross_gain_median"] == pytest.approx((0.0 + 0.2) / 2)
    assert (row["cross_pairs_at_target"], row["cross_pairs"]) == (1, 4)
    assert row["gain_of_mean_runs"] == pytest.approx(0.38 / 0.35 - 1)
    assert row["baseline_rl_spread"] == pytest.approx(0.1)


def test_runs_on_different_draws_are_refused() -> None:
    with pytest.raises(ValueError, match="seeds"):
        summarize_runs([run(0.4, 0.3), run(0.4, 0.3, seeds=[8])])
    with pytest.raises(ValueError, match="speed"):
        summarize_runs([run(0.4, 0.3), {**run(0.4, 0.3), "speed": 0.95}])
    with pytest.raises(ValueError, match="bert_router"):
        summarize_runs([run(0.4, 0.3), run(0.4, 0.3, bert=0.25)])
