from policies import build_policy
from proxy.types import NO_PREDICTION as P
from proxy.types import Prediction
from tests.policies.helpers import backends, ctx, outcome, view

B = backends(4)


def test_charges_estimates_so_a_burst_spreads() -> None:
    policy = build_policy("lowest_tpm")
    burst = [policy.pick(ctx(request_id=f"r{i}"), P, view(B)).backend for i in range(4)]
    assert sorted(b.name for b in burst) == ["b0", "b1", "b2", "b3"]


def test_sends_to_fewest_recent_tokens_and_forgets_after_window() -> None:
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


def test_estimate_is_replaced_by_reported_usage() -> None:
    policy = build_policy("lowest_tpm")
    chosen = policy.pick(ctx("z" * 400, request_id="r1", max_tokens=50), P, view(B[:1]))
    name = chosen.backend.name
    assert policy.tokens_in_window(name, 0.0) == 100 + 50  # type: ignore[attr-defined]
    policy.observe(outcome("r1", name, 70))
    assert policy.tokens_in_window(name, 0.0) == 70  # type: ignore[attr-defined]


def test_failed_attempt_releases_its_estimate() -> None:
    policy = build_policy("lowest_tpm")
    failed = policy.pick(ctx(request_id="r1", max_tokens=10_000), P, view(B[:2]))
    policy.observe(outcome("r1", failed.backend.name, 0))  # an attempt with no tokens
    assert policy.tokens_in_window(failed.backend.name, 0.0) == 0  # type: ignore[attr-defined]


def test_estimate_prefers_the_prediction_capped_by_max_tokens() -> None:
    policy = build_policy("lowest_tpm", {"default_output_tokens": 300})
    estimate = policy.estimate  # type: ignore[attr-defined]
    assert estimate(ctx("a" * 40, max_tokens=None), P) == 10 + 300
    assert estimate(ctx("a" * 40, max_tokens=64), P) == 10 + 64
    assert estimate(ctx("a" * 40, max_tokens=None), Prediction(output_tokens=120.4)) == 130
    assert estimate(ctx("a" * 40, max_tokens=64), Prediction(output_tokens=120.0)) == 74


def test_ties_rotate_instead_of_piling_on_the_first() -> None:
    policy = build_policy("lowest_tpm", {"default_output_tokens": 0})
    chosen = {policy.pick(ctx("", request_id=f"r{i}", max_tokens=None), P, view(B)).backend
              for i in range(4)}  # zero-token estimates: every score stays tied at 0
    assert len(chosen) > 1
