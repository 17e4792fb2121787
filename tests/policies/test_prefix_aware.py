from policies import build_policy
from proxy.types import NO_PREDICTION as P
from tests.policies.helpers import backends, ctx, view

B = backends(4)
SHARED = "system: you are a helpful assistant. " * 8  # 296 chars: 18 whole blocks of 16


def test_keeps_a_shared_prefix_on_one_backend() -> None:
    policy = build_policy("prefix_aware")
    first = policy.pick(ctx(SHARED + "q1"), P, view(B)).backend
    inflight = {b.name: 1 for b in B}  # equal load: the match wins
    for i in range(5):
        decision = policy.pick(ctx(SHARED + f"question {i}"), P, view(B, inflight))
        assert decision.backend == first
        assert decision.reason.startswith("prefix match 1") and first.name in decision.reason


def test_different_prompt_goes_elsewhere_under_load() -> None:
    policy = build_policy("prefix_aware")
    owner = policy.pick(ctx("a" * 200), P, view(B)).backend
    idle = next(b for b in B if b != owner)
    inflight = {b.name: 4 for b in B} | {idle.name: 0}
    decision = policy.pick(ctx("z" * 200), P, view(B, inflight))
    assert decision.backend == idle
    assert "too short" in decision.reason


def test_guard_falls_back_when_the_match_is_overloaded() -> None:
    policy = build_policy("prefix_aware", {"balance_abs_threshold": 2,
                                           "balance_rel_threshold": 1.5})
    owner = policy.pick(ctx("p" * 200), P, view(B)).backend
    busy = {b.name: 0 for b in B} | {owner.name: 9}
    decision = policy.pick(ctx("p" * 200 + "more"), P, view(B, busy))
    assert decision.backend != owner and "overloaded" in decision.reason
    # the fallback now owns the prefix: the next request follows it there
    assert policy.pick(ctx("p" * 200), P, view(B, busy)).backend == decision.backend


def test_guard_tolerates_a_small_imbalance() -> None:
    policy = build_policy("prefix_aware", {"balance_abs_threshold": 2})
    owner = policy.pick(ctx("q" * 200), P, view(B)).backend
    within = {b.name: 2 for b in B} | {owner.name: 4}  # gap 2: not over the threshold
    assert policy.pick(ctx("q" * 200 + "y"), P, view(B, within)).backend == owner


def test_guard_needs_the_relative_threshold_too() -> None:
    policy = build_policy("prefix_aware", {"balance_abs_threshold": 2,
                                           "balance_rel_threshold": 1.5})
    owner = policy.pick(ctx("r" * 200), P, view(B)).backend
    loaded = {b.name: 20 for b in B} | {owner.name: 25}  # gap 5 > 2 but 25 < 1.5 * 21
    assert policy.pick(ctx("r" * 200), P, view(B, loaded)).backend == owner


def test_short_matches_are_ignored() -> None:
    policy = build_policy("prefix_aware", {"min_match_blocks": 4})
    owner = policy.pick(ctx("m" * 48), P, view(B)).backend  # 3 blocks
    inflight = {b.name: 0 for b in B} | {owner.name: 1}
    assert policy.pick(ctx("m" * 48 + "tail"), P, view(B, inflight)).backend != owner


def test_index_is_bounded() -> None:
    policy = build_policy("prefix_aware", {"max_entries": 50})
    for i in range(100):
        policy.pick(ctx(f"{i:04d}" * 40), P, view(B))
    assert len(policy._index) == 50  # type: ignore[attr-defined]


def test_eviction_keeps_what_is_indexed_of_a_prompt_a_prefix() -> None:
    policy = build_policy("prefix_aware", {"max_entries": 30})
    old = ctx("o" * 16 * 20)  # 20 blocks
    policy.pick(old, P, view(B))
    policy.pick(ctx("n" * 16 * 15), P, view(B))  # evicts 5 of the old prompt's blocks
    index = policy._index  # type: ignore[attr-defined]
    present = [block in index for block in old.prompt_blocks]
    assert present == [True] * 15 + [False] * 5  # its deepest blocks went first


def test_deepest_match_owned_by_a_candidate_wins() -> None:
    policy = build_policy("prefix_aware")
    abc = ctx("A" * 16 + "B" * 16 + "C" * 16)
    abd = ctx("A" * 16 + "B" * 16 + "D" * 16)
    assert policy.pick(abc, P, view(B[:1])).backend.name == "b0"  # A, AB, ABC -> b0
    assert policy.pick(abd, P, view(B[1:2])).backend.name == "b1"  # A, AB, ABD -> b1
    without_b0 = policy.pick(abc, P, view(B[1:]))  # ABC's owner is out; AB's is b1
    assert without_b0.backend.name == "b1" and "2 blocks" in without_b0.reason


def test_owner_that_is_not_a_candidate_is_skipped() -> None:
    policy = build_policy("prefix_aware")
    owner = policy.pick(ctx("s" * 200), P, view(B)).backend
    others = tuple(b for b in B if b != owner)
    assert policy.pick(ctx("s" * 200), P, view(others)).backend in others
