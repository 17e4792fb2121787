"""Any params a policy's model accepts are params it routes with.

An operator sets a policy's params in the config or with `PUT /admin/policy`; the
params model (pydantic) is the only check. So for every policy that needs no files,
every field is set, one at a time, to values at the edges of what a number can be (0,
-1, 10**6, 1e-9, 1e308, and the strings "inf", "-inf", "nan", "1e308" that pydantic
reads as floats; the models refuse the three that are not finite, test below), and
each set the model accepts runs a short life: picks with no stats, with stats at their
own edges and with deadlines loose and impossible, feedback (finished, failed, empty),
a τ check when the policy moves streams, and a round of replicated updates. No call
may raise or compute a NaN, and every pick must name a candidate. A value the model
rejects is fine: the operator gets a 400 naming it.
(The same through the proxy, with hypothesis: tests/proxy/test_fuzz.py.)
"""

from __future__ import annotations

import math
import typing
from dataclasses import replace
from typing import Any

import pytest
from pydantic import ValidationError

from policies.base import POLICIES, Policy, Replicated, build_policy
from proxy.types import NO_PREDICTION, BackendStats, Outcome, Prediction, Progress, RequestContext
from tests.policies.helpers import backends, ctx, view

EDGES: tuple[Any, ...] = (0, 1, -1, 2, 10**6, 0.5, 1e-9, 1e308, "inf", "-inf", "nan",
                          "1e308")
NEEDS_FILES = {"qos_drl", "eldr"}  # their params name checkpoints (own tests)
FLEET = backends(3)
STATS = [
    {},
    {b.name: BackendStats(healthy=True) for b in FLEET},
    {FLEET[0].name: BackendStats(running=3, waiting=2, kv_usage=0.5, tpot_s=0.02,
                                 ttft_s=0.1, prefix_hit_rate=0.5, queue_s=0.05,
                                 prefill_s_per_token=0.0005, healthy=True),
     FLEET[1].name: BackendStats(running=0, tpot_s=0.0, ttft_s=0.0, queue_s=0.0,
                                 prefill_s_per_token=0.0, healthy=True),
     FLEET[2].name: BackendStats(running=10**6, waiting=10**6, kv_usage=1.0,
                                 tpot_s=1e9, ttft_s=1e9, queue_s=1e9, healthy=True)},
]


def values_for(annotation: Any) -> tuple[Any, ...]:
    """The values a field is set to: the edges for a number, every member of a
    Literal, both booleans, a per-model map at the edges."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return args
    if annotation is bool:
        return (True, False)
    if typing.get_origin(annotation) is dict:
        return tuple({"m": v} for v in EDGES)
    if annotation in (int, float) or set(args) & {int, float}:
        return EDGES
    return ()


def cases() -> list[tuple[str, dict[str, Any]]]:
    import policies  # noqa: F401  (registers every policy)

    found: list[tuple[str, dict[str, Any]]] = []
    for name in sorted(set(POLICIES) - NEEDS_FILES):
        fields = POLICIES[name].Params.model_fields
        found.append((name, {}))
        found += [(name, {key: value}) for key, field in sorted(fields.items())
                  for value in values_for(field.annotation)]
    return found


def accepted(name: str, params: dict[str, Any]) -> Policy | None:
    try:
        return build_policy(name, params)
    except ValueError:  # pydantic's ValidationError is one: the operator's 400
        return None


def requests() -> list[tuple[RequestContext, Prediction]]:
    plain = ctx("hello there " * 20, request_id="plain")
    return [(plain, NO_PREDICTION),
            (ctx("x", request_id="tiny", max_tokens=None, session="s1"),
             Prediction(output_tokens=0.0)),
            (replace(plain, request_id="loose", slo_ms=60_000.0), Prediction(output_tokens=40.0)),
            (replace(plain, request_id="tight", slo_ms=1e-3, expected_tokens=10**6),
             Prediction(output_tokens=1e9))]


def outcome(request: RequestContext, backend: str, ok: bool, tokens: int) -> Outcome:
    return Outcome(request_id=request.request_id, model="m", backend=backend, policy="p",
                   status=200 if ok else 502, ok=ok, started_at=0.0,
                   ttft_s=0.05 if ok else None, e2e_s=0.5 if tokens else 0.0,
                   completion_tokens=tokens, prompt_tokens=30 if ok else None,
                   tpot_s=0.01 if tokens > 1 else None)


@pytest.mark.filterwarnings("error:invalid value encountered:RuntimeWarning")  # a NaN sum
@pytest.mark.parametrize(("name", "params"), cases(), ids=lambda v: repr(v)[:60])
def test_params_the_model_accepts_route_without_failing(name: str,
                                                       params: dict[str, Any]) -> None:
    policy = accepted(name, params)
    if policy is None:
        return
    if isinstance(policy, Replicated):
        policy.export_updates()  # the first call starts recording
    now = 0.0
    for stats in STATS:
        for i, (request, pred) in enumerate(requests()):
            now += 1.0
            decision = policy.pick(request, pred, view(FLEET, {"b0": i, "b2": 10**6},
                                                       stats, now))
            assert decision.backend in FLEET, decision
            tokens = (0, 1, 37, 5)[i]
            policy.observe(outcome(request, decision.backend.name, i != 1, tokens))
            reroute = getattr(policy, "reroute", None)
            if reroute is not None:
                progress = Progress(decision.backend, generated=tokens, max_tokens=None,
                                    elapsed_s=math.ldexp(1, i), ttft_s=0.05,
                                    tpot_s=0.01 if tokens else None, migrations=0)
                others = tuple(b for b in FLEET if b != decision.backend)
                moved = reroute(request, pred, progress, view(others, {}, stats, now))
                if moved is not None:
                    assert moved.backend in others, moved
                    policy.observe(outcome(request, moved.backend.name, True, 3))
    if isinstance(policy, Replicated):
        twin = build_policy(name, params)
        assert isinstance(twin, Replicated)
        twin.export_updates()
        twin.merge_updates(policy.export_updates())


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", float("inf"), float("nan")])
def test_a_number_that_is_not_finite_is_refused_with_the_fields_name(name: str,
                                                                      value: Any) -> None:
    fields = POLICIES[name].Params.model_fields
    numeric = [key for key, field in fields.items()
               if field.annotation is float or float in typing.get_args(field.annotation)]
    for key in numeric:
        with pytest.raises(ValidationError, match=key):
            POLICIES[name].Params.model_validate({key: value})
