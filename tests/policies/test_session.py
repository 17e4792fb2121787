from collections import Counter

from policies import Policy, build_policy
from proxy.types import NO_PREDICTION as P
from proxy.types import ClusterView
from tests.policies.helpers import backends, ctx, view

B = backends(4)
SESSIONS = [f"user-{i}" for i in range(10_000)]


def owners(cluster: ClusterView, policy: Policy | None = None) -> dict[str, str]:
    policy = policy or build_policy("session")
    return {s: policy.pick(ctx(session=s), P, cluster).backend.name for s in SESSIONS}


def test_same_session_same_backend_and_balanced() -> None:
    policy = build_policy("session")
    before = owners(view(B), policy)
    assert before == owners(view(B), policy)
    assert min(Counter(before.values()).values()) > len(SESSIONS) / 4 * 0.7


def test_stable_across_instances_and_processes() -> None:
    # No salted `hash()`: a fresh policy (another replica) agrees, and so do pinned values.
    assert owners(view(B)) == owners(view(B))
    picked = build_policy("session").pick(ctx(session="alice"), P, view(B)).backend.name
    assert picked == build_policy("session").pick(ctx(session="alice"), P, view(B)).backend.name


def test_adding_a_backend_moves_about_one_in_n_plus_one() -> None:
    policy = build_policy("session")
    before = owners(view(B), policy)
    grown = backends(5)
    after = owners(view(grown), policy)
    moved = [s for s in SESSIONS if before[s] != after[s]]
    assert len(moved) <= 1.5 * len(SESSIONS) / 5
    assert {after[s] for s in moved} == {"b4"}  # only onto the new backend
    assert after == owners(view(grown))  # same as a replica that only ever saw 5


def test_unhealthy_primary_goes_to_next_on_ring_deterministically() -> None:
    policy = build_policy("session")
    primary = policy.pick(ctx(session="alice"), P, view(B)).backend
    rest = tuple(b for b in B if b != primary)
    fallback = {policy.pick(ctx(session="alice"), P, view(rest)).backend for _ in range(5)}
    assert len(fallback) == 1 and primary not in fallback
    other_replica = build_policy("session").pick(ctx(session="alice"), P, view(rest)).backend
    assert fallback == {other_replica}
    assert policy.pick(ctx(session="alice"), P, view(B)).backend == primary  # comes back


def test_losing_a_backend_moves_only_its_sessions() -> None:
    policy = build_policy("session")
    before = owners(view(B), policy)
    after = owners(view(B[1:]), policy)
    assert all(after[s] == before[s] for s in SESSIONS if before[s] != "b0")


def test_no_session_uses_least_loaded() -> None:
    policy = build_policy("session")
    inflight = {"b0": 2, "b1": 2, "b2": 0, "b3": 2}
    decisions = [policy.pick(ctx(), P, view(B, inflight)) for _ in range(4)]
    assert {d.backend.name for d in decisions} == {"b2"}
    assert all("no session" in d.reason for d in decisions)
