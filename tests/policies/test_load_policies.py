"""round_robin, random, least_request, power_of_two, shortest_queue."""

from collections import Counter

from policies import build_policy
from proxy.types import NO_PREDICTION as P
from proxy.types import BackendStats
from tests.policies.helpers import backends, ctx, view

B = backends(4)


def picks(name: str, n: int, **kw: object) -> list[str]:
    policy = build_policy(name, {})
    return [policy.pick(ctx(), P, view(B, **kw)).backend.name for _ in range(n)]  # type: ignore[arg-type]


def test_round_robin_cycles_evenly() -> None:
    assert picks("round_robin", 8) == ["b0", "b1", "b2", "b3"] * 2
    assert set(Counter(picks("round_robin", 400)).values()) == {100}


def test_round_robin_keeps_cycling_when_candidates_change() -> None:
    policy = build_policy("round_robin")
    without_b1 = tuple(b for b in B if b.name != "b1")
    chosen = [policy.pick(ctx(), P, view(without_b1)).backend.name for _ in range(6)]
    assert Counter(chosen) == {"b0": 2, "b2": 2, "b3": 2}


def test_random_is_seeded_and_covers_all() -> None:
    a = build_policy("random", {"seed": 7})
    b = build_policy("random", {"seed": 7})
    seq_a = [a.pick(ctx(), P, view(B)).backend.name for _ in range(200)]
    assert seq_a == [b.pick(ctx(), P, view(B)).backend.name for _ in range(200)]
    assert min(Counter(seq_a).values()) > 200 / 4 * 0.5


def test_least_request_avoids_busy_and_spreads_ties() -> None:
    chosen = picks("least_request", 9, inflight={"b0": 3, "b1": 0, "b2": 0, "b3": 5})
    assert set(chosen) == {"b1", "b2"}
    assert abs(chosen.count("b1") - chosen.count("b2")) <= 1


def test_least_request_reason_names_the_load() -> None:
    decision = build_policy("least_request").pick(ctx(), P, view(B, {"b0": 1, "b1": 2,
                                                                    "b2": 1, "b3": 1}))
    assert decision.backend.name != "b1" and "least in-flight 1" in decision.reason


def test_power_of_two_never_takes_the_busier_of_its_two() -> None:
    inflight = {"b0": 0, "b1": 1, "b2": 2, "b3": 3}
    chosen = Counter(picks("power_of_two", 600, inflight=inflight))
    assert "b3" not in chosen  # the busiest always loses its pair
    # b0 wins all 3 pairs it is in, b1 two, b2 one: 1/2, 1/3, 1/6 of 600
    assert chosen["b0"] > chosen["b1"] > chosen["b2"] > 0


def test_power_of_two_breaks_inflight_ties_with_the_scrape() -> None:
    stats = {"b0": BackendStats(running=9, healthy=True), "b1": BackendStats(healthy=True)}
    policy = build_policy("power_of_two", {"seed": 1})
    two = B[:2]
    assert {policy.pick(ctx(), P, view(two, stats=stats)).backend.name
            for _ in range(20)} == {"b1"}


def test_power_of_two_with_one_candidate() -> None:
    assert build_policy("power_of_two").pick(ctx(), P, view(B[:1])).backend == B[0]


def test_shortest_queue_adds_scrape_and_inflight() -> None:
    stats = {"b0": BackendStats(running=4, waiting=2, healthy=True),
             "b1": BackendStats(running=1, healthy=True),
             "b2": BackendStats(running=0, healthy=True),
             "b3": BackendStats(running=0, waiting=1, healthy=True)}
    # queues: b0 6, b1 1, b2 0 + 3 in-flight = 3, b3 1
    chosen = picks("shortest_queue", 4, stats=stats, inflight={"b2": 3})
    assert Counter(chosen) == {"b1": 2, "b3": 2}


def test_shortest_queue_prefers_fewer_inflight_on_equal_queues() -> None:
    stats = {"b0": BackendStats(running=3, healthy=True), "b1": BackendStats(healthy=True)}
    inflight = {"b0": 0, "b1": 3, "b2": 9, "b3": 9}  # b0 and b1 both queue 3
    assert set(picks("shortest_queue", 6, stats=stats, inflight=inflight)) == {"b0"}
