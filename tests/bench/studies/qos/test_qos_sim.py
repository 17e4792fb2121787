"""The qos_drl simulator: Poisson arrivals on emulator engines, φ per request, drops,
impact coefficients from the step model, and the baseline routers."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from bench.emulator.profile import load_profile
from bench.studies.qos.evaluate import bert_router, evaluate, round_robin, shortest_queue
from bench.studies.qos.setup import fit_coefficients
from bench.studies.qos.sim import QosSim, TraceArrivals, spread_groups
from policies.qos_drl.impact import impact
from tests.bench.studies.qos.qos_helpers import pool, specs


def test_coefficients_are_the_step_models_slopes() -> None:
    profile = load_profile("t4")
    k = fit_coefficients(profile)
    step = profile.step
    # prefill: b + e·(p+1)/2 per token, on average over the grid; decode: d per context token
    assert step.per_token_s < k.k1 < step.per_token_s + step.per_pair_s * 1024
    # decode: d per context token, plus the per-token/per-seq cost of the batch spread
    # over at least 128 context tokens per request (the grid's shortest)
    per_seq = step.per_token_s + step.per_seq_s + step.per_context_s
    assert step.per_context_s < k.k2 < step.per_context_s + per_seq / 128


def test_requests_complete_with_latency_per_token_and_qos() -> None:
    sim = QosSim(specs(), pool(), rate=2.0, limit_s=1.0, seed=1)
    for action in (1, 2, 0):
        sim.arrive()
        sim.route(action)
    sim.drain()
    by_expert = {r.expert: r for r in sim.finished}
    assert set(by_expert) == {-1, 0, 1}
    assert by_expert[-1].qos == 0.0  # dropped
    assert by_expert[0].qos == 0.9 and by_expert[1].qos == 0.2  # generous L: φ = s
    slow, fast = by_expert[0], by_expert[1]
    assert slow.latency_per_token is not None and fast.latency_per_token is not None
    assert slow.latency_per_token > fast.latency_per_token


def test_a_tight_limit_zeroes_qos_and_route_returns_the_impact_on_its_expert() -> None:
    sim = QosSim(specs(), pool(), rate=50.0, limit_s=0.004, seed=2)
    for _ in range(12):
        sim.arrive()
        sim.route(1)
    sim.drain()
    assert all(r.qos == 0.0 for r in sim.finished)  # tiny-llama-large: > 4 ms per token
    sim = QosSim(specs(), pool(), rate=20.0, limit_s=0.03, seed=2)
    for _ in range(10):
        sim.arrive()
        sim.route(1)
    req = sim.arrive()
    running = sim.running(0)
    assert running and all(r.generated > 0 for r in running)
    expected = impact(specs()[0].k, running, req.prompt.prompt_tokens, req.prompt.lengths[0],
                      0.03)
    assert sim.route(1) == pytest.approx(expected)
    sim.arrive()
    assert sim.route(2) == 0.0  # nobody runs on the other expert
    sim.arrive()
    assert sim.route(0) == 0.0  # a drop hurts nobody


def test_state_follows_the_queues() -> None:
    sim = QosSim(specs(), pool(), rate=100.0, limit_s=0.05, seed=3)
    for _ in range(8):
        sim.arrive()
        sim.route(2)
    sim.arrive()
    g = sim.state()
    assert g.experts[1, 1] * 10 + g.experts[1, 2] * 10 == pytest.approx(8)
    engine = sim.experts[1].engine
    assert g.running_mask[1].sum() == min(5, len(engine.running))
    assert g.waiting_mask[1].sum() == min(5, len(engine.waiting))
    assert g.running_mask[0].sum() == 0


def test_baseline_routers_and_evaluation() -> None:
    sim = QosSim(specs(), pool(), rate=5.0, limit_s=1.0, seed=4)
    bert = evaluate(sim, bert_router(), 30)
    assert bert.expert_share == [1.0, 0.0] and bert.drop_rate == 0.0
    assert bert.avg_qos == pytest.approx(0.9)
    rr = evaluate(sim, round_robin(), 30)
    assert rr.expert_share == [0.5, 0.5] and rr.avg_qos == pytest.approx(0.55)
    sqf = evaluate(sim, shortest_queue, 30)
    assert sqf.arrivals == 30 and sum(sqf.expert_share) == pytest.approx(1.0)


def test_experts_sharing_cores_slow_each_other_only_beyond_the_cores() -> None:
    def lpt(cores: float | None, actions: tuple[int, ...], solo: float = 1.0,
            speed: float = 1.0) -> dict[int, float]:
        sim = QosSim(specs(), pool(), rate=1000.0, limit_s=1.0, seed=5, cores=cores,
                     solo=solo, speed=speed)
        for action in actions:
            sim.arrive()
            sim.route(action)
        sim.drain()
        return {r.expert: r.latency_per_token or 0.0 for r in sim.finished}

    alone = lpt(None, (1,))[0]
    assert lpt(1, (1,))[0] == pytest.approx(alone)  # one engine busy: no contention
    together = lpt(None, (1, 2))
    assert lpt(2, (1, 2)) == pytest.approx(together)  # two engines, two cores
    shared = lpt(1, (1, 2))
    # on one core each step of either lasts twice as long while both have work
    assert shared[1] == pytest.approx(2 * together[1], rel=0.1)
    # the slow expert (60 tokens) loses the time the fast one (30 tokens) worked alone
    assert shared[0] * 60 == pytest.approx(together[0] * 60 + together[1] * 30, rel=0.1)
    # the part of the machine left to the engines (bench.studies.qos.setup.TINY_CORES)
    assert lpt(1.35, (1,))[0] == pytest.approx(alone)
    assert lpt(1.6, (1, 2))[1] == pytest.approx(2 / 1.6 * together[1], rel=0.1)
    # an engine busy alone on a core not quite its own (bench.studies.qos.setup.TINY_SOLO_SLOWDOWN)
    assert lpt(1.35, (1,), solo=1.5)[0] == pytest.approx(1.5 * alone, rel=0.05)
    # while both have work k / cores (2) rules; the slow one's tail alone runs at solo
    contended = lpt(1, (1, 2), solo=1.5)
    assert contended[1] == pytest.approx(shared[1])
    assert contended[0] > shared[0] * 1.1
    # a machine 1.3x slower than the fit: every step, alone, shared or on hardware
    # of its own, on top of the sharing
    assert lpt(None, (1,), speed=1.3)[0] == pytest.approx(1.3 * alone, rel=0.05)
    assert lpt(None, (1, 2), speed=1.3) == pytest.approx(
        {n: 1.3 * v for n, v in together.items()}, rel=0.05)
    assert lpt(1, (1, 2), speed=1.3) == pytest.approx(
        {n: 1.3 * v for n, v in shared.items()}, rel=0.05)
    assert lpt(1.35, (1,), solo=1.5, speed=1.3)[0] == pytest.approx(1.3 * 1.5 * alone,
                                                                     rel=0.05)


def test_predictions_are_cached_whole_next_to_the_artifact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache is written under another name and renamed (two trainers may start
    together), then read back instead of running the predictor again."""
    import json
    from types import SimpleNamespace

    import predictors.buckets.predictor
    from bench.studies.qos.setup import predictions_model
    from predictors.buckets.data import PromptRow

    calls: list[int] = []

    class Predictor:
        def predict_batch(self, prompts: list[str]) -> list[SimpleNamespace]:
            calls.append(len(prompts))
            return [SimpleNamespace(score=[0.5, 0.1], length=[len(p), 9.0]) for p in prompts]

    monkeypatch.setattr(predictors.buckets.predictor, "load_artifact",
                        lambda artifact, estimate: Predictor())
    (tmp_path / "meta.json").write_text(json.dumps({"version": "v1"}))
    rows = [PromptRow(i, "x" * i, (0.0, 0.0), (1, 1)) for i in range(40)]
    first = predictions_model(tmp_path, rows)
    assert calls == [32, 8] and first[7] == ([0.5, 0.1], [7.0, 9.0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "predictions.json"]
    assert predictions_model(tmp_path, rows) == first and calls == [32, 8]
    (tmp_path / "meta.json").write_text(json.dumps({"version": "v2"}))  # retrained
    predictions_model(tmp_path, rows)
    assert calls == [32, 8, 32, 8]


TIMES = (*(float(3 * (i // 4)) for i in range(40)), 200.0, 201.0)  # groups of 4, 3 s apart


def test_a_trace_window_is_scaled_to_the_rate_and_reproducible() -> None:
    trace = TraceArrivals(TIMES, window=12, spread=False)
    gaps = trace.gaps(random.Random(1), rate=5.0)
    assert len(gaps) == 12 and sum(gaps) / 12 == pytest.approx(1 / 5)
    assert gaps == trace.gaps(random.Random(1), rate=5.0)
    # logged together, they arrive together: three of every four gaps are zero
    assert 6 <= sum(g == 0 for g in gaps) <= 9
    spread = TraceArrivals(TIMES, window=12).gaps(random.Random(1), rate=5.0)
    assert all(g > 0 for g in spread) and sum(spread) / 12 == pytest.approx(1 / 5)


def test_spread_groups_stay_within_their_logged_step() -> None:
    times = spread_groups([0.0, 0.0, 0.0, 3.0, 3.0, 9.0], random.Random(2))
    assert times == sorted(times)
    assert all(0 <= t < 3 for t in times[:3]) and all(3 <= t < 9 for t in times[3:5])
    assert 9 <= times[5] < 9 + 4.5  # the last group: over the median step (3, 6 → 6)


def test_the_simulator_arrives_at_the_traces_times() -> None:
    trace = TraceArrivals(TIMES, window=20)
    sim = QosSim(specs(), pool(), rate=5.0, limit_s=1.0, seed=3, trace=trace)
    expected = trace.gaps(random.Random(3 + 2), 5.0)
    arrivals = [sim.arrive().arrival for _ in range(25)]  # past the window: from its start
    assert arrivals == pytest.approx(list(itertools.accumulate(expected + expected[:5])))
    # A Poisson simulator's arrivals are the same with a trace elsewhere in the process.
    poisson = [QosSim(specs(), pool(), rate=5.0, limit_s=1.0, seed=3).arrive().arrival
               for _ in range(2)]
    assert poisson[0] == poisson[1] and poisson[0] != arrivals[0]


def test_a_trace_without_a_whole_window_is_refused() -> None:
    with pytest.raises(ValueError, match="no window"):
        TraceArrivals(TIMES[:5], window=5)
