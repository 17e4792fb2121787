from collections import Counter

import pytest
from pydantic import ValidationError

from policies import POLICIES, build_policy
from policies.base import UnknownPolicyError
from predictors.base import NO_PREDICTION as P
from proxy.types import BackendStats

from tests.policies.helpers import backends, ctx, outcome, view

B = backends(4)


def picks(name: str, n: int, **kw: object) -> list[str]:
    policy = build_policy(name, {})
    return [policy.pick(ctx(), P, view(B, **kw)).backend.name for _ in range(n)]  # type: ignore[arg-type]


def test_registry_has_every_classic_policy() -> None:
    assert set(POLICIES) >= {"round_robin", "random", "least_request", "power_of_two",
                             "shortest_queue", "lowest_tpm", "prefix_aware", "session"}


def test_build_policy_rejects_unknown_names_and_params() -> None:
    with pytest.raises(UnknownPolicyError, match="nope"):
        build_policy("nope")
    with pytest.raises(ValidationError, match="bogus"):
        build_policy("prefix_aware", {"bogus": 1})
    with pytest.raises(ValidationError, match="balance_rel_threshold"):
        build_policy("prefix_aware", {"balance_rel_threshold": 0.5})


def test_round_robin_cycles_evenly() -> None:
    assert picks("round_robin", 8) == ["b0", "b1", "b2", "b3"] * 2


def test_random_is_seeded_and_covers_all() -> None:
    a = build_policy("random", {"seed": 7})
    b = build_policy("random", {"seed": 7})
    seq_a = [a.pick(ctx(), P, view(B)).backend.name for _ in range(200)]
    assert seq_a == [b.pick(ctx(), P, view(B)).backend.name for _ in range(200)]
    assert set(seq_a) == {x.name for x in B}


def test_least_request_avoids_busy_and_spreads_ties() -> None:
    chosen = picks("least_request", 9, inflight={"b0": 3, "b1": 0, "b2": 0, "b3": 5})
    assert set(chosen) == {"b1", "b2"}
    assert abs(chosen.count("b1") - chosen.count("b2")) <= 1


def test_power_of_two_never_takes_the_busier_of_its_two() -> None:
    inflight = {"b0": 0, "b1": 1, "b2": 2, "b3": 3}
    chosen = Counter(picks("power_of_two", 600, inflight=inflight))
    assert "b3" not in chosen  # the busiest always loses its pair
    assert chosen["b0"] > chosen["b1"] > chosen["b2"]


def test_shortest_queue_adds_scrape_and_inflight() -> None:
    stats = {"b0": BackendStats(running=4, waiting=2, healthy=True),
             "b1": BackendStats(running=1, healthy=True),
             "b2": BackendStats(running=0, healthy=True),
             "b3": BackendStats(running=0, waiting=1, healthy=True)}
    assert set(picks("shortest_queue", 4, stats=stats, inflight={"b2": 3})) == {"b1", "b3"}


def test_lowest_tpm_charges_estimates_and_forgets_after_window() -> None:
    policy = build_policy("lowest_tpm", {"window_s": 60})
    first = policy.pick(ctx("x" * 400, request_id="r1", max_tokens=100), P, view(B[:2]))
    second = policy.pick(ctx("y", request_id="r2", max_tokens=1), P, view(B[:2]))
    assert first.backend != second.backend  # the open estimate already counts
    policy.observe(outcome("r1", first.backend.name, 5000, at=0.0))
    policy.observe(outcome("r2", second.backend.name, 10, at=0.0))
    again = policy.pick(ctx(request_id="r3", max_tokens=1), P, view(B[:2], now=30.0))
    assert again.backend == second.backend  # fewer tokens in the window
    policy.observe(outcome("r3", again.backend.name, 10_000, at=30.0))
    later = policy.pick(ctx(request_id="r4", max_tokens=1), P, view(B[:2], now=61.0))
    assert later.backend == first.backend  # r1's 5000 left the window, r3's 10000 did not


def test_lowest_tpm_releases_failed_attempts() -> None:
    policy = build_policy("lowest_tpm", {})
    failed = policy.pick(ctx(request_id="r1", max_tokens=10_000), P, view(B[:2]))
    policy.observe(outcome("r1", failed.backend.name, 0))  # an attempt with no tokens
    assert policy._usage[failed.backend.name].score(-1.0) == 0  # type: ignore[attr-defined]


def test_prefix_aware_keeps_shared_prefix_on_one_backend() -> None:
    policy = build_policy("prefix_aware", {})
    shared = "system: you are helpful. " * 8
    first = policy.pick(ctx(shared + "q1"), P, view(B)).backend
    inflight = {b.name: 1 for b in B}  # equal load: the match wins
    for i in range(5):
        assert policy.pick(ctx(shared + f"question {i}"), P, view(B, inflight)).backend == first


def test_prefix_aware_unmatched_goes_to_least_loaded() -> None:
    policy = build_policy("prefix_aware", {})
    policy.pick(ctx("a" * 200), P, view(B))
    inflight = {"b0": 4, "b1": 4, "b2": 0, "b3": 4}
    assert policy.pick(ctx("z" * 200), P, view(B, inflight)).backend.name == "b2"


def test_prefix_aware_guard_falls_back_when_match_is_overloaded() -> None:
    policy = build_policy("prefix_aware", {"balance_abs_threshold": 2,
                                           "balance_rel_threshold": 1.5})
    owner = policy.pick(ctx("p" * 200), P, view(B)).backend
    busy = {b.name: 0 for b in B} | {owner.name: 9}
    decision = policy.pick(ctx("p" * 200 + "more"), P, view(B, busy))
    assert decision.backend != owner and "overloaded" in decision.reason


def test_prefix_aware_guard_tolerates_a_small_imbalance() -> None:
    policy = build_policy("prefix_aware", {"balance_abs_threshold": 2})
    owner = policy.pick(ctx("q" * 200), P, view(B)).backend
    within = {b.name: 2 for b in B} | {owner.name: 4}  # gap 2: not over the threshold
    assert policy.pick(ctx("q" * 200 + "y"), P, view(B, within)).backend == owner


def test_prefix_aware_index_is_bounded() -> None:
    policy = build_policy("prefix_aware", {"max_entries": 50})
    for i in range(100):
        policy.pick(ctx(f"{i:04d}" * 40), P, view(B))
    assert len(policy._index) == 50  # type: ignore[attr-defined]


def test_prefix_aware_ignores_owner_that_is_not_a_candidate() -> None:
    policy = build_policy("prefix_aware", {})
    owner = policy.pick(ctx("s" * 200), P, view(B)).backend
    others = tuple(b for b in B if b != owner)
    assert policy.pick(ctx("s" * 200), P, view(others)).backend in others


def test_session_is_sticky_and_consistent() -> None:
    policy = build_policy("session", {})
    sessions = [f"user-{i}" for i in range(10_000)]
    before = {s: policy.pick(ctx(session=s), P, view(B)).backend.name for s in sessions}
    assert before == {s: policy.pick(ctx(session=s), P, view(B)).backend.name for s in sessions}
    assert min(Counter(before.values()).values()) > 10_000 / 4 * 0.7  # roughly balanced
    grown = backends(5)
    after = {s: policy.pick(ctx(session=s), P, view(grown)).backend.name for s in sessions}
    moved = sum(before[s] != after[s] for s in sessions)
    assert moved <= 1.5 * len(sessions) / 5
    assert all(after[s] == "b4" for s in sessions if before[s] != after[s])


def test_session_fails_over_deterministically() -> None:
    policy = build_policy("session", {})
    primary = policy.pick(ctx(session="alice"), P, view(B)).backend
    rest = tuple(b for b in B if b != primary)
    fallback = {policy.pick(ctx(session="alice"), P, view(rest)).backend for _ in range(5)}
    assert len(fallback) == 1 and primary not in fallback
    assert policy.pick(ctx(session="alice"), P, view(B)).backend == primary  # comes back


def test_session_without_id_uses_least_loaded() -> None:
    assert set(picks("session", 4, inflight={"b0": 2, "b1": 2, "b2": 0, "b3": 2})) == {"b2"}
