"""The clairvoyant lookahead routers of bench.studies.qos.headroom and QosSim.what_if."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from bench.studies.qos.evaluate import evaluate, round_robin
from bench.studies.qos.headroom import (
    lookahead,
    mean_result,
    predicted_qos,
    previous_table,
    true_qos,
)
from bench.studies.qos.setup import partly_oracle
from bench.studies.qos.sim import QosSim
from tests.bench.studies.qos.qos_helpers import pool, specs


def test_what_if_finishes_the_fleet_on_a_copy_and_leaves_the_simulator_as_it_was() -> None:
    sim = QosSim(specs(), pool(), rate=20.0, limit_s=0.03, seed=3)
    for action in (1, 2, 1):
        sim.arrive()
        sim.route(action)
    current = sim.arrive()
    outcome = sim.what_if(2)
    assert len(outcome) == 4 and all(r.qos is not None for r in outcome)
    assert [r.prompt.id for r in outcome if r.expert == 1][-1] == current.prompt.id
    assert sim.finished == [] and current.expert == -1  # nothing here moved on
    # the same arrivals afterwards as a simulator that never looked ahead
    twin = QosSim(specs(), pool(), rate=20.0, limit_s=0.03, seed=3)
    for action in (1, 2, 1):
        twin.arrive()
        twin.route(action)
    twin.arrive()
    sim.route(1)
    twin.route(1)
    assert (sim.arrive().prompt.id, sim.now) == (twin.arrive().prompt.id, twin.now)
    sim.drain()
    twin.drain()
    assert [r.qos for r in sim.finished] == [r.qos for r in twin.finished]


def test_lookahead_takes_the_better_expert_while_it_meets_the_limit_then_the_other() -> None:
    # every prompt: 0.9 on the slow expert, 0.2 on the fast one
    # (tests.bench.studies.qos.qos_helpers)
    idle = QosSim(specs(), pool(), rate=0.5, limit_s=1.0, seed=1)
    idle.arrive()
    assert lookahead(true_qos)(idle) == 1
    # L = 3 ms: a lone request on the 12-layer profile misses it (~5.3 ms per token),
    # on the 2-layer one meets it (~1.7 ms)
    tight = QosSim(specs(), pool(), rate=0.5, limit_s=0.003, seed=1)
    tight.arrive()
    assert [r.qos for r in tight.what_if(1)] == [0.0]
    assert lookahead(true_qos)(tight) == 2


def test_the_predicted_score_judge_reads_the_predictor_not_the_judge() -> None:
    sim = QosSim(specs(), [replace(p, pred_scores=(0.1, 0.3)) for p in pool()],
                 rate=0.5, limit_s=1.0, seed=1)
    sim.arrive()
    assert lookahead(true_qos)(sim) == 1  # true 0.9 vs 0.2
    assert lookahead(predicted_qos)(sim) == 2  # predicted 0.1 vs 0.3
    done = sim.what_if(2)
    assert predicted_qos(done[0], sim.limit) == 0.3 and true_qos(done[0], sim.limit) == 0.2


def test_lookahead_beats_round_robin_in_the_simulator() -> None:
    sim = QosSim(specs(), pool(), rate=4.0, limit_s=0.06, seed=5)
    assert evaluate(sim, lookahead(true_qos), 30).avg_qos > evaluate(
        sim, round_robin(), 30).avg_qos


def test_a_run_adds_to_the_rows_of_one_made_with_the_same_setup(tmp_path: Path) -> None:
    out = tmp_path / "headroom.json"
    setup = {"fleet": {"a": "t4"}, "cores": None, "limit_ms": 30.0, "seed": 7}
    assert previous_table(out, setup) == {}
    row = {"5": {"baseline_rl": {"avg_qos": 0.4}}}
    out.write_text(json.dumps(setup | {"table": row}))
    assert previous_table(out, setup) == row
    assert previous_table(out, setup | {"seed": 8}) == {}  # another setup: start afresh


def test_a_partial_oracle_swaps_only_its_half_of_the_predictions() -> None:
    model = {1: ([0.5, 0.5], [100.0, 200.0]), 2: ([0.4, 0.6], [50.0, 70.0])}
    truth = {1: ([0.9, 0.1], [30.0, 400.0]), 2: ([0.0, 1.0], [10.0, 90.0])}
    assert partly_oracle(model, truth, "score") == {
        1: ([0.9, 0.1], [100.0, 200.0]), 2: ([0.0, 1.0], [50.0, 70.0])}
    assert partly_oracle(model, truth, "length") == {
        1: ([0.5, 0.5], [30.0, 400.0]), 2: ([0.4, 0.6], [10.0, 90.0])}
    with pytest.raises(ValueError):
        partly_oracle(model, truth, "both")


def test_several_seeds_report_the_mean_of_each_field_and_every_seed_s_qos() -> None:
    runs = [asdict(evaluate(QosSim(specs(), pool(), rate=20.0, limit_s=0.03, seed=seed),
                            round_robin(), 30)) for seed in (3, 4)]
    assert runs[0]["lpt_mean_ms"] != runs[1]["lpt_mean_ms"]  # the seeds: other arrivals
    assert mean_result(runs[:1]) == runs[0]
    mean = mean_result(runs)
    assert mean["avg_qos"] == pytest.approx((runs[0]["avg_qos"] + runs[1]["avg_qos"]) / 2)
    assert mean["avg_qos_per_seed"] == [runs[0]["avg_qos"], runs[1]["avg_qos"]]
    assert mean["lpt_mean_ms"] == pytest.approx(
        (runs[0]["lpt_mean_ms"] + runs[1]["lpt_mean_ms"]) / 2)
    assert mean["arrivals"] == 60
    assert mean["expert_share"] == pytest.approx(
        [(a + b) / 2 for a, b in zip(runs[0]["expert_share"], runs[1]["expert_share"],
                                     strict=True)])
    assert sum(mean["expert_share"]) == pytest.approx(1.0)
