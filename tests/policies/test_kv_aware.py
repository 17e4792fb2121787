"""policies/kv_aware.py on synthetic views: the exact cached prefix wins, the load
guard overrides it, and backends without KV events are approximated."""

from __future__ import annotations

from policies.base import build_policy
from policies.kv_aware import KvAware, KvAwareParams
from proxy.types import CachedPrefix, Prediction
from tests.policies.helpers import backends, ctx, view

LONG = "system prompt shared by many requests. " * 20


def test_it_declares_the_cached_prefix_stage() -> None:
    policy = build_policy("kv_aware", {"tokenize_timeout_s": 0.25})
    assert policy.stages() == (CachedPrefix(0.25),)  # type: ignore[attr-defined]


def test_the_backend_with_the_longest_cached_prefix_wins() -> None:
    policy = KvAware(KvAwareParams())
    fleet = backends(3)
    pred = Prediction(cached_prefix_tokens={"b0": 16, "b1": 256, "b2": 0})
    for _ in range(4):  # not a tie-break rotating by luck
        decision = policy.pick(ctx(LONG), pred, view(fleet, {"b0": 0, "b1": 2, "b2": 0}))
        assert decision.backend.name == "b1"
        assert "256 prefix tokens cached on b1" in decision.reason


def test_the_load_guard_overrides_the_cache_when_it_is_overloaded() -> None:
    policy = KvAware(KvAwareParams(balance_abs_threshold=4, balance_rel_threshold=1.5))
    fleet = backends(2)
    pred = Prediction(cached_prefix_tokens={"b0": 512, "b1": 0})
    assert policy.pick(ctx(LONG), pred, view(fleet, {"b0": 5, "b1": 1})).backend.name == "b0"
    overloaded = policy.pick(ctx(LONG), pred, view(fleet, {"b0": 20, "b1": 1}))
    assert overloaded.backend.name == "b1" and "overloaded" in overloaded.reason


def test_a_short_cached_prefix_goes_to_the_least_loaded() -> None:
    policy = KvAware(KvAwareParams(min_match_tokens=64))
    pred = Prediction(cached_prefix_tokens={"b0": 32, "b1": 0})
    decision = policy.pick(ctx(LONG), pred, view(backends(2), {"b0": 3, "b1": 1}))
    assert decision.backend.name == "b1" and "too short" in decision.reason


def test_without_events_it_approximates_from_what_it_sent() -> None:
    policy = KvAware(KvAwareParams())
    fleet = backends(3)
    first = policy.pick(ctx(LONG + "first"), Prediction(), view(fleet))
    # no exact lengths at all (the stage could not tokenize): the backend sent the prefix
    # wins, wherever the least-loaded rotation would go
    for loads in ({}, {first.backend.name: 1}):
        again = policy.pick(ctx(LONG + "second"), Prediction(), view(fleet, loads))
        assert again.backend == first.backend and "approx" in again.reason


def test_a_backend_without_events_competes_through_the_approximation() -> None:
    policy = KvAware(KvAwareParams())
    fleet = backends(2)
    # b1 has no events: b0's exact map says it holds nothing of this prompt
    only_b0 = Prediction(cached_prefix_tokens={"b0": 0})
    sent = policy.pick(ctx(LONG + "a"), only_b0, view(fleet, {"b0": 0, "b1": 1}))
    assert sent.backend.name == "b0"  # nothing matched anywhere: least loaded
    # now b0 holds nothing per its events, although this policy sent it the prefix:
    # the exact 0 beats the memory of sending; b1 has no memory either -> least loaded
    again = policy.pick(ctx(LONG + "b"), only_b0, view(fleet, {"b0": 1, "b1": 0}))
    assert again.backend.name == "b1"
    # b1 (no events) was sent the prefix; b0's events say 32 tokens: the approximation
    # (the whole shared text, ~200 tokens) wins
    third = policy.pick(ctx(LONG + "c"), Prediction(cached_prefix_tokens={"b0": 32}),
                        view(fleet, {"b0": 0, "b1": 0}))
    assert third.backend.name == "b1" and "approx" in third.reason
