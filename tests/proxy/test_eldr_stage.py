"""ELDR's PD mode: the prefill leg, the signature, and the decode-pool pick."""

from __future__ import annotations

import base64
import io
import json
from types import MappingProxyType

import httpx
import numpy as np

from policies.eldr import Eldr, EldrParams
from predictors.base import NO_PREDICTION
from predictors.eldr_fit import EldrModel
from predictors.experts import SignatureSpec, normalize
from proxy.eldr_stage import PrefillStage
from proxy.stages import stages_for
from proxy.types import Backend, ClusterView
from tests.policies.helpers import ctx

PREFILL = Backend("p0", "http://p0", "m", MappingProxyType(
    {"role": "prefill", "eldr_url": "http://p0-eldr"}))
DECODERS = (Backend("d0", "http://d0", "m"), Backend("d1", "http://d1", "m"))
VIEW = ClusterView((PREFILL, *DECODERS), {}, {}, 0.0)
# d0's centroid is expert 0 of the one layer, d1's is expert 1.
MODEL = EldrModel(SignatureSpec(np.ones((1, 2)), (0,)), normalize(np.eye(2)), ("d0", "d1"))


def eldr() -> Eldr:
    return Eldr(EldrParams(artifact="-", pd=True), MODEL)


def transport(seen: list[httpx.Request], fail: bool = False) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.host == "p0":
            return httpx.Response(200, json={"choices": [{"text": "x"}]})
        if fail:
            return httpx.Response(404, json={"error": "unknown request"})
        return httpx.Response(200, json={"prefill": [[1, 9]], "decode": [[0, 0]]})
    return httpx.MockTransport(handle)


async def test_prefill_leg_yields_the_signature_and_decode_avoids_the_prefill_pool() -> None:
    seen: list[httpx.Request] = []
    policy = eldr()
    stage = PrefillStage(policy, transport=transport(seen))
    context = ctx(request_id="req-1")
    pred = await stage.predict(context, {"model": "m", "prompt": "hi", "max_tokens": 50,
                                         "stream": True}, NO_PREDICTION, VIEW)
    await stage.close()
    leg, lookup = seen
    assert json.loads(leg.content) == {"model": "m", "prompt": "hi", "max_tokens": 1,
                                       "stream": False}
    assert leg.headers["X-Request-Id"] == "req-1"
    assert str(lookup.url) == "http://p0-eldr/eldr/requests/req-1"
    assert pred.expert_signature is not None
    assert np.allclose(pred.expert_signature, normalize(np.array([1.0, 9.0])))
    assert policy.pick(context, pred, VIEW).backend.name == "d1"
    assert policy.pick(context, NO_PREDICTION, VIEW).backend.name in {"d0", "d1"}


async def test_a_failed_lookup_leaves_the_prediction_without_a_signature() -> None:
    stage = PrefillStage(eldr(), transport=transport([], fail=True))
    pred = await stage.predict(ctx(), {"prompt": "hi"}, NO_PREDICTION, VIEW)
    await stage.close()
    assert pred is NO_PREDICTION


async def test_only_eldr_in_pd_mode_gets_a_prefill_stage() -> None:
    assert stages_for(Eldr(EldrParams(artifact="-"), MODEL)) == []
    [stage] = stages_for(eldr())
    assert isinstance(stage, PrefillStage)
    await stage.close()


async def test_routed_experts_in_the_response_need_no_side_endpoint() -> None:
    ids = np.array([[[1, 0]], [[1, 1]], [[1, 0]]], np.uint8)  # 3 tokens, 1 layer, top-2
    buffer = io.BytesIO()
    np.save(buffer, ids, allow_pickle=False)
    encoded = base64.b64encode(buffer.getvalue()).decode()
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"choices": [{"text": "x", "routed_experts": encoded}]})

    gpu_prefill = Backend("p0", "http://p0", "m", MappingProxyType({"role": "prefill"}))
    stage = PrefillStage(eldr(), transport=httpx.MockTransport(handle))
    view = ClusterView((gpu_prefill, *DECODERS), {}, {}, 0.0)
    pred = await stage.predict(ctx(), {"prompt": "hi"}, NO_PREDICTION, view)
    await stage.close()
    assert len(seen) == 1 and pred.expert_signature is not None
    assert np.allclose(pred.expert_signature, normalize(np.array([2.0, 4.0])))
