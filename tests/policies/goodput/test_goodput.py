"""GoodServe's decisions on constructed fleets: feasible set, just-enough choice,
fallback, prefix reuse, the EMA speed model and the rectification trigger."""

from __future__ import annotations

import dataclasses

import pytest

from policies.goodput.policy import Goodput, GoodputParams
from proxy.types import (
    NO_PREDICTION,
    Backend,
    BackendStats,
    LengthPrior,
    Outcome,
    Prediction,
    Progress,
    RequestContext,
)
from tests.policies.helpers import backends, ctx, outcome, view

FLEET = backends(3)  # b0 fast, b1 medium, b2 slow
TPOT = {"b0": 0.010, "b1": 0.020, "b2": 0.040}


def stats(tpot: dict[str, float] = TPOT, queue: float = 0.0, at: float = 1.0
          ) -> dict[str, BackendStats]:
    return {name: BackendStats(tpot_s=t, queue_s=queue, prefill_s_per_token=0.0,
                               healthy=True, updated_at=at) for name, t in tpot.items()}


def policy(**params: object) -> Goodput:
    return Goodput(GoodputParams(block_chars=16, **params))  # type: ignore[arg-type]


def request(slo_s: float | None, prompt: str = "p" * 40, max_tokens: int | None = 100
            ) -> RequestContext:
    base = ctx(prompt, max_tokens=max_tokens)
    return dataclasses.replace(base, slo_ms=None if slo_s is None else slo_s * 1000)


HUNDRED = Prediction(output_tokens=100)


@pytest.mark.parametrize(("slo_s", "chosen"), [
    (4.5, "b2"),  # all feasible (T = 1, 2, 4 s): the slowest that still meets it
    (2.5, "b1"),  # b2 misses: the slowest feasible is b1, not the fastest
    (1.5, "b0"),  # only b0 meets it
    (0.5, "b0"),  # nobody does: the least overrun
])
def test_just_enough_picks_the_slowest_feasible_backend(slo_s: float, chosen: str) -> None:
    decision = policy().pick(request(slo_s), HUNDRED, view(FLEET, stats=stats()))
    assert decision.backend.name == chosen, decision.reason


def test_eq2_terms_queue_prefill_and_decode() -> None:
    fleet_stats = {"b0": BackendStats(queue_s=0.5, prefill_s_per_token=0.01, tpot_s=0.01,
                                      healthy=True, updated_at=1)}
    times = policy().estimates(request(9.0, prompt="x" * 400), 100, view(FLEET[:1],
                                                                         stats=fleet_stats))
    ((_, total, tpot),) = times
    assert total == pytest.approx(0.5 + 0.01 * 100 + 0.01 * 100)  # 400 chars = 100 tokens
    assert tpot == 0.01


def test_prefix_reuse_lowers_prefill_where_the_prompt_was_sent() -> None:
    slow_prefill = {n: BackendStats(tpot_s=0.01, prefill_s_per_token=0.01, healthy=True,
                                    updated_at=1) for n in ("b0", "b1")}
    goodput = policy()
    shared = "s" * 320  # 20 blocks of 16 chars = 80 tokens
    first = goodput.pick(request(9.0, prompt=shared), HUNDRED, view(FLEET[:2],
                                                                   stats=slow_prefill))
    times = {b.name: t for b, t, _ in goodput.estimates(
        request(9.0, prompt=shared + "tail"), 100, view(FLEET[:2], stats=slow_prefill))}
    other = "b1" if first.backend.name == "b0" else "b0"
    assert times[first.backend.name] == pytest.approx(times[other] - 0.8)


def test_no_slo_falls_back_to_least_in_flight() -> None:
    decision = policy().pick(request(None), HUNDRED,
                             view(FLEET, inflight={"b0": 3, "b1": 0, "b2": 5}, stats=stats()))
    assert decision.backend.name == "b1" and "no SLO" in decision.reason


def test_default_slo_per_model_and_oracle_length() -> None:
    goodput = policy(default_slo_s={"m": 2.5}, length_source="max_tokens")
    # max_tokens 100 is the oracle length: same as predicting 100.
    assert goodput.pick(request(None), NO_PREDICTION, view(FLEET, stats=stats())
                        ).backend.name == "b1"


def test_hint_length_reads_the_clients_header_under_a_larger_max_tokens() -> None:
    goodput = policy(length_source="hint")
    hinted = dataclasses.replace(request(2.5, max_tokens=1000), expected_tokens=100)
    # the hint (100 tokens: T = 1, 2, 4 s) makes b1 just enough; max_tokens 1000 would not
    assert goodput.pick(hinted, NO_PREDICTION, view(FLEET, stats=stats())
                        ).backend.name == "b1"
    # no header: the predictor's length (1000 -> nobody meets 2.5 s, the least overrun b0)
    unhinted = request(2.5, max_tokens=1000)
    assert goodput.pick(unhinted, Prediction(output_tokens=1000), view(FLEET, stats=stats())
                        ).backend.name == "b0"


def test_speed_model_is_an_ema_of_snapshots_and_outcomes() -> None:
    goodput = policy(alpha=0.5)
    goodput.pick(request(9.0), HUNDRED, view(FLEET[:1], stats=stats({"b0": 0.010})))
    goodput.pick(request(9.0), HUNDRED, view(FLEET[:1], stats=stats({"b0": 0.030}, at=2)))
    ((_, _, tpot),) = goodput.estimates(request(9.0), 1, view(FLEET[:1], stats=stats(
        {"b0": 0.030}, at=2)))  # the same snapshot again is not folded in twice
    assert tpot == pytest.approx(0.020)
    goodput.observe(Outcome(request_id="r", model="m", backend="b0", policy="goodput",
                            status=200, ok=True, started_at=0, ttft_s=0.1, e2e_s=1,
                            completion_tokens=50, tpot_s=0.040))
    ((_, _, tpot),) = goodput.estimates(request(9.0), 1, view(FLEET[:1], stats=stats(
        {"b0": 0.030}, at=2)))
    assert tpot == pytest.approx(0.030)


def progress(on: Backend, generated: int, elapsed_s: float, tpot_s: float) -> Progress:
    return Progress(backend=on, generated=generated, max_tokens=400, elapsed_s=elapsed_s,
                    ttft_s=0.1, tpot_s=tpot_s, migrations=0)


def test_rectification_moves_an_at_risk_stream_to_the_just_enough_faster_backend() -> None:
    goodput = policy(handoff_s=0.0)
    slow = FLEET[2]
    # 50 tokens done after 2 s on b2; 350 left at 40 ms = 14 s more; the SLO is 10 s.
    # b1 would finish in 2 + 7 = 9 s (feasible, just enough); b0 in 5.5 s.
    decision = goodput.reroute(request(10.0, max_tokens=400), Prediction(output_tokens=400),
                               progress(slow, 50, 2.0, 0.040),
                               view(FLEET[:2], stats=stats()))
    assert decision is not None and decision.backend.name == "b1", decision


def test_rectification_leaves_on_track_streams_and_has_nowhere_faster() -> None:
    goodput = policy(handoff_s=0.0)
    on_track = goodput.reroute(request(30.0, max_tokens=400), Prediction(output_tokens=400),
                               progress(FLEET[2], 50, 2.0, 0.040),
                               view(FLEET[:2], stats=stats()))
    assert on_track is None  # 2 + 14 s < 30 s
    fastest = goodput.reroute(request(3.0, max_tokens=400), Prediction(output_tokens=400),
                              progress(FLEET[0], 50, 2.0, 0.010),
                              view(FLEET[1:], stats=stats()))
    assert fastest is None  # at risk, but every other backend is slower


def test_rectification_uses_the_overrun_rule_and_can_be_disabled() -> None:
    # Predicted 40 tokens but 200 are out: remaining = 0.25 * 200 = 50 tokens, so
    # staying finishes at 0.5 + 50 * 40 ms = 2.5 s > 2 s; b1 would finish at 1.5 s.
    args = (request(2.0, max_tokens=400), Prediction(output_tokens=40),
            progress(FLEET[2], 200, 0.5, 0.040), view(FLEET[:2], stats=stats()))
    moved = policy(handoff_s=0.0).reroute(*args)
    assert moved is not None and moved.backend.name == "b1"
    assert policy(handoff_s=0.0, migrate=False).reroute(*args) is None
    assert policy(handoff_s=0.0, min_gain_s=1.5).reroute(*args) is None  # gains only 1 s


def test_rescue_only_skips_moves_that_still_miss_the_slo() -> None:
    # 350 tokens left on b2 at 40 ms (finish 16 s); the SLO is 5 s. b0 would finish at
    # 2 + 3.5 = 5.5 s: sooner, but still late. The paper's rule (the default) moves it
    # (least overrun); rescue_only keeps it where it is. With an SLO of 6 s b0 rescues it.
    args = (Prediction(output_tokens=400), progress(FLEET[2], 50, 2.0, 0.040),
            view(FLEET[:2], stats=stats()))
    paper = policy(handoff_s=0.0).reroute(request(5.0, max_tokens=400), *args)
    assert paper is not None and paper.backend.name == "b0"
    rescue = policy(handoff_s=0.0, rescue_only=True)
    assert rescue.reroute(request(5.0, max_tokens=400), *args) is None
    rescued = rescue.reroute(request(6.0, max_tokens=400), *args)
    assert rescued is not None and rescued.backend.name == "b0"


def test_risk_speed_estimate_judges_the_stream_by_its_backends_ema() -> None:
    # On b2 the stream ran at 40 ms/token so far; b2's EMA d_g says 15 ms now (the
    # scrape after a burst drained). 350 tokens left, SLO 10 s, 2 s elapsed: by its own
    # TPOT it finishes at 16 s (at risk, b1 is faster: moves); by the estimate at 7.25 s
    # (on track: stays).
    fleet_stats = stats({"b0": 0.010, "b1": 0.020, "b2": 0.015})
    args = (request(10.0, max_tokens=400), Prediction(output_tokens=400),
            progress(FLEET[2], 50, 2.0, 0.040), view(FLEET[:2], stats=fleet_stats))
    moved = policy(handoff_s=0.0).reroute(*args)
    assert moved is not None and moved.backend.name == "b1"
    assert policy(handoff_s=0.0, risk_speed="estimate").reroute(*args) is None


def test_running_streams_are_speed_samples_per_window() -> None:
    """Each τ check's window (tokens since the previous check, on the same backend) is
    an EMA sample of d_g; a window that spans a move is not; an outcome forgets it."""
    slow = FLEET[2]
    ctx_, fleet_view = request(100.0), view(FLEET, stats=stats())
    sampled, unsampled = policy(alpha=1.0), policy(alpha=1.0, stream_samples=False)
    for goodput in (sampled, unsampled):
        goodput.pick(ctx_, HUNDRED, fleet_view)  # seeds d_g from the scrape: 40 ms
        goodput.reroute(ctx_, HUNDRED, progress(slow, 50, 2.0, 0.040), fleet_view)
        # the next 50 tokens took 5 s: 100 ms per token while the backend is loaded
        goodput.reroute(ctx_, HUNDRED, progress(slow, 100, 7.0, 0.070), fleet_view)
    assert sampled.estimates(ctx_, 100, fleet_view)[2][2] == pytest.approx(0.100)
    assert unsampled.estimates(ctx_, 100, fleet_view)[2][2] == pytest.approx(0.040)
    # moved to b1 after 100 tokens: its first check there has no window yet
    sampled.reroute(ctx_, HUNDRED, progress(FLEET[1], 150, 8.0, 0.020), fleet_view)
    assert sampled.estimates(ctx_, 100, fleet_view)[1][2] == pytest.approx(0.020)
    sampled.observe(Outcome(ctx_.request_id, "m", "b1", "goodput", 200, True, 0.0, 0.1,
                            9.0, 200))
    assert ctx_.request_id not in sampled._windows


def test_capability_selection_spreads_within_the_slowest_hardware_tier() -> None:
    """Algorithm 1 sends to the largest *current* d_g: of two slow instances of one GPU
    type that is the loaded one. `selection: capability` keeps the slowest hardware tier
    (the lowest d_g each has shown) and picks the one with the fewest in flight."""
    fleet = backends(3)  # b0 fast; b1, b2 the same slow hardware
    idle = {"b0": 0.010, "b1": 0.030, "b2": 0.030}
    busy = {"b0": 0.010, "b1": 0.036, "b2": 0.031}  # b1 carries more load now
    for selection, chosen in (("paper", "b1"), ("capability", "b2")):
        g = policy(selection=selection, alpha=1.0)
        g.pick(request(9.0), HUNDRED, view(fleet, stats=stats(idle, at=1.0)))
        decision = g.pick(request(9.0), HUNDRED, view(fleet, {"b1": 4, "b2": 1},
                                                      stats(busy, at=2.0)))
        assert decision.backend.name == chosen, decision.reason
    assert "slowest tier" in decision.reason and "1 in flight" in decision.reason


def test_capability_selection_keeps_feasibility_and_the_fallback() -> None:
    g = policy(selection="capability", alpha=1.0)
    # T = 1, 2, 4 s: at D = 2.5 s b2 is out however idle it is; b1 is the tier
    decision = g.pick(request(2.5), HUNDRED, view(FLEET, {"b1": 9}, stats()))
    assert decision.backend.name == "b1", decision.reason
    # nobody meets 0.5 s: the least overrun, as Algorithm 1
    assert g.pick(request(0.5), HUNDRED, view(FLEET, stats=stats())).backend.name == "b0"
    # tolerance: a backend within 20 % of the slowest capability is in its tier
    near = {"b0": 0.010, "b1": 0.035, "b2": 0.040}
    g = policy(selection="capability", alpha=1.0)
    decision = g.pick(request(9.0), HUNDRED, view(FLEET, {"b2": 3}, stats(near, at=3.0)))
    assert decision.backend.name == "b1", decision.reason


def test_infeasible_least_loaded_keeps_hopeless_requests_off_the_fastest() -> None:
    """Nobody meets 0.5 s (T = 1, 2, 4 s). Algorithm 1: the least overrun, b0, however
    loaded; `infeasible: least_loaded`: the backend with the fewest in flight (ties:
    the least overrun). A feasible request is routed as before."""
    loaded = view(FLEET, {"b0": 5, "b1": 2, "b2": 2}, stats())
    assert policy().pick(request(0.5), HUNDRED, loaded).backend.name == "b0"
    g = policy(infeasible="least_loaded")
    decision = g.pick(request(0.5), HUNDRED, loaded)
    assert decision.backend.name == "b1", decision.reason  # b1 and b2 tie at 2: T 2 < 4
    assert "least loaded (2 in flight)" in decision.reason
    assert g.pick(request(2.5), HUNDRED, loaded).backend.name == "b1"  # just enough
    assert g.pick(request(1.5), HUNDRED, loaded).backend.name == "b0"  # only b0 meets it
    # with protect, a request that would harm everywhere goes to the least loaded too
    protected = policy(infeasible="least_loaded", protect=True, selection="capability")
    assert protected.pick(request(0.5), HUNDRED, loaded).backend.name == "b1"
    with pytest.raises(ValueError):
        policy(infeasible="drop")


def test_capability_is_the_lowest_d_seen_from_real_samples() -> None:
    from policies.goodput.speed import Speed, SpeedModel

    model = SpeedModel(0.5, Speed(0.0, 0.0, 0.03))
    assert model.capability("x") is None
    model.of("x", BackendStats(healthy=True, updated_at=1.0))  # no TPOT yet: the default
    assert model.peek("x").best_tpot_s is None and model.capability("x") == 0.03  # type: ignore[union-attr]
    model.observe_tpot("x", 0.05)  # 0.04
    model.observe_tpot("x", 0.01)  # 0.025
    model.observe_tpot("x", 0.05)  # 0.0375
    assert model.capability("x") == pytest.approx(0.025)


def test_speed_columns_mirror_every_change_to_the_estimates() -> None:
    """Eq. 2 runs on the model's arrays: they must equal the `Speed` records after
    snapshots (a new backend seeded from its first one, a newer one folded by EMA),
    outcomes, other replicas' estimates, subsets of the candidates and growth."""
    from policies.goodput.speed import Speed, SpeedModel

    model = SpeedModel(0.5, Speed(0.0, 0.0, 0.03))

    def tpots(candidates: tuple[Backend, ...], snapshot: dict[str, BackendStats]
              ) -> list[float]:
        _, _, _, tpot = model.columns(candidates, snapshot)
        assert tpot.tolist() == [model.peek(b.name).tpot_s  # type: ignore[union-attr]
                                 for b in candidates]
        return tpot.tolist()

    first = stats()
    assert tpots(FLEET, first) == pytest.approx([0.010, 0.020, 0.040])  # seeded, no EMA
    newer = {**first, "b1": stats({"b1": 0.060}, at=2)["b1"]}
    assert tpots(FLEET, newer) == pytest.approx([0.010, 0.040, 0.040])
    assert tpots(FLEET, dict(newer)) == pytest.approx([0.010, 0.040, 0.040])  # seen: kept
    model.observe_tpot("b0", 0.030)
    model.blend("b2", 0.0, 0.0, 0.080)
    assert tpots(FLEET, newer) == pytest.approx([0.020, 0.040, 0.060])
    assert tpots((FLEET[2], FLEET[0]), newer) == pytest.approx([0.060, 0.020])
    many = backends(100)  # past the arrays' first size
    snapshot = stats({b.name: 0.001 * (i + 1) for i, b in enumerate(many)})
    assert tpots(many, snapshot)[3:] == pytest.approx([0.001 * (i + 1) for i in range(3, 100)])
    queue = model.columns(many, snapshot)[1]
    assert queue.tolist() == [0.0] * 100


def test_estimates_subsets_keep_rows_together() -> None:
    goodput = policy()
    times = goodput.estimates(request(9.0), 100, view(FLEET, stats=stats()))
    assert [(b.name, t) for b, t, _ in times] == [("b0", pytest.approx(1.0)),
                                                  ("b1", pytest.approx(2.0)),
                                                  ("b2", pytest.approx(4.0))]
    slower = times.where(times.tpot > 0.015)
    assert [b.name for b, _, _ in slower] == ["b1", "b2"] and len(slower) == 2
    rest = slower.without(FLEET[1])
    assert [b.name for b, _, _ in rest] == ["b2"] and rest.of(FLEET[2]) == pytest.approx(4.0)
    assert not rest.without(FLEET[2])


@pytest.mark.parametrize(("slo_s", "chosen"), [
    (4.5, "b1"),  # b2's T = 4 s is within D but not within 0.75 D = 3.4 s
    (5.5, "b2"),  # 0.75 D = 4.1 s: b2 fits again
    (1.2, "b0"),  # nobody fits 0.9 s: the least overrun is still the fastest
])
def test_headroom_keeps_a_margin_below_the_deadline(slo_s: float, chosen: str) -> None:
    decision = policy(headroom=0.25).pick(request(slo_s), HUNDRED, view(FLEET, stats=stats()))
    assert decision.backend.name == chosen, decision.reason


def test_load_fit_is_a_line_through_running_and_tpot() -> None:
    from policies.goodput.speed import LoadFit, Speed, SpeedModel

    fit = LoadFit(weight=0.5)
    for n in (2, 2, 2):  # one load level: no slope to see
        fit.add(n, 0.02)
    assert fit.slope() == 0.0 and fit.at(10) == pytest.approx(0.02)
    for n in (0, 4, 8, 12, 16, 0, 8, 16):  # d = 10 ms + 1 ms per running request
        fit.add(n, 0.010 + 0.001 * n)
    # the first samples (off the line) have all but faded: weight 0.5 over 8 samples
    assert fit.slope() == pytest.approx(0.001, rel=0.02)
    assert fit.at(20) == pytest.approx(0.030, rel=0.02)
    falling = LoadFit(weight=0.5)
    for n in (0, 10, 0, 10):
        falling.add(n, 0.02 - 0.001 * n)
    assert falling.slope() == 0.0  # never faster under more load

    model = SpeedModel(0.3, Speed(0.0, 0.0, 0.03), load_alpha=0.2, load_min_samples=3)
    for i, n in enumerate((1, 5, 9)):
        assert model.tpot_at("x", 10) is None  # too few snapshots yet
        model.of("x", BackendStats(running=n, tpot_s=0.010 + 0.002 * n, healthy=True,
                                   updated_at=float(i + 1)))
    model.of("x", BackendStats(running=30, tpot_s=None, healthy=True, updated_at=9.0))
    assert model.tpot_at("x", 13) == pytest.approx(0.036)  # no TPOT: not a sample


def test_speed_at_load_prices_the_batch_a_request_would_join() -> None:
    """The slow backend's EMA says 40 ms, but with 20 requests in flight its fit says
    30 ms + 1 ms x 21: Algorithm 1 finds it feasible, speed_at_load does not."""
    goodput = {on: policy(speed_at_load=on, load_min_samples=3) for on in (False, True)}
    for i, n in enumerate((0, 5, 10, 15)):  # b2's history: 30 ms + 1 ms per request
        snapshot = stats({"b0": 0.010, "b1": 0.020, "b2": 0.030 + 0.001 * n}, at=float(i + 1))
        snapshot["b2"] = dataclasses.replace(snapshot["b2"], running=n)
        for g in goodput.values():
            g.estimates(request(9.0), 1, view(FLEET, stats=snapshot))
    loaded = view(FLEET, inflight={"b2": 20}, stats=stats(
        {"b0": 0.010, "b1": 0.020, "b2": 0.040}, at=4.0))
    assert goodput[False].pick(request(4.5), HUNDRED, loaded).backend.name == "b2"
    decision = goodput[True].pick(request(4.5), HUNDRED, loaded)
    assert decision.backend.name == "b1", decision.reason  # b2: 51 ms x 100 = 5.1 s > 4.5
    idle = view(FLEET, stats=stats({"b0": 0.010, "b1": 0.020, "b2": 0.040}, at=4.0))
    assert goodput[True].pick(request(4.5), HUNDRED, idle).backend.name == "b2"  # 31 ms


def arriving(request_id: str, slo_s: float, at: float, prompt_tokens: int = 100
             ) -> RequestContext:
    """A prompt of its own (no prefix shared with another request's)."""
    return dataclasses.replace(request(slo_s, prompt=request_id * (4 * prompt_tokens)),
                               request_id=request_id, arrived_at=at)


PREFILL = {n: BackendStats(tpot_s=t, prefill_s_per_token=0.005, healthy=True, updated_at=1)
           for n, t in TPOT.items()}  # T(100 in, 100 out) = 0.5 + 1 / 2 / 4 s


def test_protect_refuses_a_backend_where_the_admission_would_make_another_miss() -> None:
    """A (deadline 5 s) runs on b2 with 0.5 s of slack; B's 200-token prompt would stall
    b2's decode steps for 1 s: Algorithm 1 sends B there anyway (T = 5 s <= 5 s), protect
    sends it to the next slowest feasible backend."""
    chosen = {}
    for on in (False, True):
        goodput = policy(protect=on)
        first = goodput.pick(arriving("A", 5.0, at=0.0), HUNDRED, view(FLEET, stats=PREFILL))
        assert first.backend.name == "b2"
        second = goodput.pick(arriving("B", 5.0, at=0.5, prompt_tokens=200), HUNDRED,
                              view(FLEET, inflight={"b2": 1}, stats=PREFILL, now=0.5))
        chosen[on] = second
    assert chosen[False].backend.name == "b2"
    assert chosen[True].backend.name == "b1", chosen[True].reason
    assert "protect: 1 refused" in chosen[True].reason and "b2 for A" in chosen[True].reason


def test_protect_ignores_doomed_and_finished_requests_and_counts_progress() -> None:
    goodput = policy(protect=True, migrate=False)  # A stays on b2
    goodput.pick(arriving("A", 5.0, at=0.0), HUNDRED, view(FLEET, stats=PREFILL))
    late = view(FLEET, inflight={"b2": 1}, stats=PREFILL, now=1.5)
    # at 1.5 s A (decoding since 0.5 s at 40 ms) has ~75 tokens left: finish 4.5 s, so
    # 0.5 s of slack: a 1 s stall would still make it miss
    assert goodput.pick(arriving("B", 8.0, at=1.5, prompt_tokens=200), HUNDRED,
                        late).backend.name == "b1"
    # A reported only 10 tokens at 1.5 s (a slow start): 90 left, finish 5.1 s: it
    # misses anyway, so it no longer holds b2 back
    goodput.reroute(arriving("A", 5.0, at=0.0), HUNDRED,
                    progress(FLEET[2], generated=10, elapsed_s=1.5, tpot_s=0.1), late)
    assert goodput.pick(arriving("C", 8.0, at=1.5, prompt_tokens=200), HUNDRED,
                        late).backend.name == "b2"
    goodput = policy(protect=True)
    goodput.pick(arriving("A", 5.0, at=0.0), HUNDRED, view(FLEET, stats=PREFILL))
    goodput.observe(outcome("A", "b2", 100))
    assert goodput.pick(arriving("B", 5.0, at=0.5, prompt_tokens=200), HUNDRED,
                        view(FLEET, stats=PREFILL, now=0.5)).backend.name == "b2"


def test_protect_prices_the_load_fits_slowdown_and_follows_moves() -> None:
    """No prefill: only the fit's 1 ms per request more on b2 can harm A (100 tokens
    left at 40 ms, 0.05 s of slack: +0.1 s). alpha 1: d_g is the latest snapshot's."""
    goodput = policy(protect=True, load_min_samples=3, alpha=1.0)
    for i, n in enumerate((10, 5, 0)):  # b2: 39 ms + 1 ms per running request
        snapshot = stats({"b0": 0.010, "b1": 0.020, "b2": 0.039 + 0.001 * n}, at=float(i + 1))
        snapshot["b2"] = dataclasses.replace(snapshot["b2"], running=n)
        goodput.estimates(request(9.0), 1, view(FLEET, stats=snapshot))
    fleet = stats({"b0": 0.010, "b1": 0.020, "b2": 0.039}, at=3.0)  # seen already
    assert goodput.pick(arriving("A", 4.05, at=0.0), HUNDRED,
                        view(FLEET, stats=fleet)).backend.name == "b2"
    busy = view(FLEET, inflight={"b2": 1}, stats=fleet)
    assert goodput.pick(arriving("B", 9.0, at=0.0), HUNDRED, busy).backend.name == "b1"
    # A moved to b0 (a τ check's move, seen through the old leg's outcome): b2 is free
    goodput.observe(dataclasses.replace(outcome("A", "b2", 0), moved_to="b0"))
    assert goodput.pick(arriving("C", 9.0, at=0.0), HUNDRED, busy).backend.name == "b2"


def test_protect_sends_a_request_that_harms_everywhere_to_the_least_overrun() -> None:
    goodput = policy(protect=True)
    for name, at in (("A", "b0"), ("B", "b1"), ("C", "b2")):  # one tight request each
        slo = {"b0": 1.6, "b1": 2.6, "b2": 4.6}[at]
        chosen = goodput.pick(arriving(name, slo, at=0.0), HUNDRED,
                              view(FLEET, stats=PREFILL))
        assert chosen.backend.name == at
    decision = goodput.pick(arriving("D", 9.0, at=0.0, prompt_tokens=200), HUNDRED,
                            view(FLEET, inflight=dict.fromkeys(TPOT, 1), stats=PREFILL))
    assert decision.backend.name == "b0"  # T = 2 s, the least of 2 / 3 / 5 s
    assert "all 3 would harm" in decision.reason


def test_harmful_moves_off_keeps_a_stream_that_would_harm_on_every_faster_backend() -> None:
    """A (b0) and B (b1) each finish 0.1 s inside their deadlines; C, at risk on b2, would
    re-prefill 110 tokens (0.55 s) on either: protect strikes both, and then the move goes
    to the least overrun of them anyway, or (harmful_moves off) C stays."""
    moved = {}
    for harmful in (True, False):
        goodput = policy(protect=True, harmful_moves=harmful)
        for name, slo, at in (("A", 1.6, "b0"), ("B", 2.6, "b1")):
            chosen = goodput.pick(arriving(name, slo, at=0.0), HUNDRED,
                                  view(FLEET, stats=PREFILL))
            assert chosen.backend.name == at
        busy = view(FLEET, inflight=dict.fromkeys(TPOT, 1), stats=PREFILL, now=1.0)
        # C: 90 tokens left at 40 ms, finish 4.6 s > 4 s; b1 or b0 would finish by 3.4 s
        moved[harmful] = goodput.reroute(arriving("C", 4.0, at=0.0), HUNDRED,
                                         progress(FLEET[2], 10, 1.0, 0.040), busy)
    assert moved[True] is not None and moved[True].backend.name == "b0"
    assert "all 2 would harm" in moved[True].reason
    assert moved[False] is None
    goodput.observe(outcome("B", "b1", 100))  # B is done: b1 harms nobody now
    rescued = goodput.reroute(arriving("C", 4.0, at=0.0), HUNDRED,
                              progress(FLEET[2], 10, 1.0, 0.040), busy)
    assert rescued is not None and rescued.backend.name == "b1", rescued


def test_placements_follow_moves_and_forget_the_oldest_past_their_bound() -> None:
    from policies.goodput.placements import Placed, Placements

    placed = Placements(limit=2)
    for rid, backend in (("a", "b0"), ("b", "b0"), ("a", "b1")):  # "a" again: it moved
        placed.place(Placed(rid, backend, deadline_at=9.0, output_tokens=10, max_tokens=None))
    assert [p.request_id for p in placed.on("b0")] == ["b"]
    assert [p.request_id for p in placed.on("b1")] == ["a"]
    placed.progress("a", "b2", generated=5, at=1.0, output_tokens=20)
    (a,) = placed.on("b2")
    assert (a.generated, a.counted_at, a.output_tokens) == (5, 1.0, 20)
    placed.place(Placed("c", "b0", deadline_at=9.0, output_tokens=10, max_tokens=None))
    assert len(placed) == 2 and not list(placed.on("b2"))  # "a", the oldest, is gone
    placed.finish("b")
    assert [p.request_id for p in placed.on("b0")] == ["c"]


def test_length_quantile_routes_on_what_requests_predicted_alike_ran_to() -> None:
    """Predicted 100 tokens, but such requests ran to 300: with the calibration the
    slow backend (T = 4 s at 100 tokens, 12 s at 300) is no longer just enough."""
    good = policy(length_quantile=0.9, calibration_min_samples=3)
    fleet = view(FLEET, stats=stats())
    long = dataclasses.replace(request(4.5, max_tokens=1000), request_id="x")
    assert good.pick(long, HUNDRED, fleet).backend.name == "b2"  # no samples: Algorithm 1
    for i in range(3):
        r = dataclasses.replace(long, request_id=f"r{i}")
        good.pick(r, HUNDRED, fleet)
        good.observe(dataclasses.replace(outcome(r.request_id, "b2", 300), status=499,
                                         ok=False))  # a client that stopped reading
    # 300 tokens: b0 (3 s) is the only backend within 4.5 s
    decision = good.pick(long, HUNDRED, fleet)
    assert decision.backend.name == "b0"
    assert "L_out 300: the q0.9 of requests predicted like its 100" in decision.reason
    capped = dataclasses.replace(long, request_id="y", max_tokens=150)  # 150 tokens: b1
    assert good.pick(capped, HUNDRED, fleet).backend.name == "b1"


@pytest.mark.parametrize(("prior", "chosen"), [(True, "b0"), (False, "b2")])
def test_a_length_prior_calibrates_the_first_request(prior: bool, chosen: str) -> None:
    """The artifact's out-of-fold answers predicted at 100 ran to 300: with
    `calibration_prior` the first request already routes on 300 (b0 alone meets 4.5 s),
    without it on the prediction (Algorithm 1: b2)."""
    good = policy(length_quantile=0.9, calibration_min_samples=3, calibration_prior=prior)
    first = Prediction(output_tokens=100,
                       length_prior=LengthPrior("m", tuple((100.0, 300) for _ in range(5))))
    long = dataclasses.replace(request(4.5, max_tokens=1000), request_id="x")
    assert good.pick(long, first, view(FLEET, stats=stats())).backend.name == chosen


@pytest.mark.parametrize(("fallback", "chosen"), [("overrun", "b0"), ("prediction", "b1")])
def test_quantile_fallback_when_no_backend_meets_the_calibrated_length(
        fallback: str, chosen: str) -> None:
    """Calibrated to 300 tokens with D = 2.5 s, nobody meets it (b0: 3 s): the least
    overrun is b0; with the prediction fallback Algorithm 1 runs on the 100 predicted
    tokens, where b1 (2 s) is just enough."""
    good = policy(length_quantile=0.9, calibration_min_samples=3, quantile_fallback=fallback)
    fleet = view(FLEET, stats=stats())
    for i in range(3):
        r = dataclasses.replace(request(60.0, max_tokens=1000), request_id=f"r{i}")
        good.pick(r, HUNDRED, fleet)
        good.observe(outcome(r.request_id, "b2", 300))
    decision = good.pick(dataclasses.replace(request(2.5, max_tokens=1000), request_id="x"),
                         HUNDRED, fleet)
    assert decision.backend.name == chosen
    if fallback == "prediction":
        assert "L_out 100, the prediction: no backend meets D for 300" in decision.reason
    else:
        assert "none feasible" in decision.reason
    # where some backend meets the calibrated length the fallback changes nothing
    loose = good.pick(dataclasses.replace(request(12.5, max_tokens=1000), request_id="y"),
                      HUNDRED, fleet)
    assert loose.backend.name == "b2" and "L_out 300:" in loose.reason


def test_length_quantile_learns_only_from_predicted_finished_requests() -> None:
    good = policy(length_quantile=0.9, calibration_min_samples=1, length_source="hint")
    fleet = view(FLEET, stats=stats())
    moved, failed, hinted = (dataclasses.replace(request(4.5, max_tokens=1000), request_id=i)
                             for i in ("moved", "failed", "hinted"))
    for r in (moved, failed):
        good.pick(r, HUNDRED, fleet)
    good.pick(dataclasses.replace(hinted, expected_tokens=100), HUNDRED, fleet)
    good.observe(dataclasses.replace(outcome("moved", "b2", 300), moved_to="b0"))  # a leg
    good.observe(dataclasses.replace(outcome("failed", "b2", 300), status=502, ok=False))
    good.observe(outcome("never-picked", "b2", 300))
    good.observe(outcome("hinted", "b2", 300))  # L_out was the client's, not predicted
    assert good.pick(request(4.5, max_tokens=1000), HUNDRED, fleet).backend.name == "b2"
    good.observe(outcome("moved", "b0", 300))  # the moved request's end counts
    assert good.pick(request(4.5, max_tokens=1000), HUNDRED, fleet).backend.name == "b0"


def test_calibrated_checks_read_how_far_requests_that_ran_as_long_went() -> None:
    """Predicted 100 tokens; at 120 generated the overrun rule expects 30 more (on
    track on b2), the calibration 280 more, as requests predicted alike that ran past
    120 did: the stream moves."""
    fleet = view(FLEET, stats=stats())
    moves = []
    for checks in (False, True):
        good = policy(length_quantile=0.5, calibration_min_samples=10,
                      calibrate_checks=checks)
        for i in range(10):
            done = dataclasses.replace(request(60.0, max_tokens=1000), request_id=f"d{i}")
            good.pick(done, HUNDRED, fleet)
            good.observe(outcome(done.request_id, "b2", 400))
        r = dataclasses.replace(request(9.0, max_tokens=1000), request_id="s")
        good.pick(r, HUNDRED, fleet)
        moves.append(good.reroute(r, HUNDRED, progress(FLEET[2], 120, 4.8, 0.04),
                                  fleet))
    assert moves[0] is None  # 4.8 + 30 x 0.04 = 6 s <= 9 s
    assert moves[1] is not None and moves[1].backend.name in ("b0", "b1")
