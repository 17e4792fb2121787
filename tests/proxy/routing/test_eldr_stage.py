"""ELDR's PD mode: the prefill leg, the signature, and the decode-pool pick."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import logging
from collections.abc import AsyncIterator
from types import MappingProxyType
from typing import Any

import httpx
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from pydantic import ValidationError

from policies.eldr import Eldr, EldrParams
from predictors.eldr.experts import SignatureSpec, normalize
from predictors.eldr.fit import EldrModel
from proxy.fleet.registry import Registry
from proxy.routing.eldr_stage import PrefillStage
from proxy.routing.kv_transfer import handle_of
from proxy.routing.stage_builder import stages_for
from proxy.types import NO_PREDICTION, Backend, ClusterView, PrefillSignature
from tests.policies.helpers import ctx

DECODERS = (Backend("d0", "http://d0", "m"), Backend("d1", "http://d1", "m"))
# d0's centroid is expert 0 of the one layer, d1's is expert 1.
MODEL = EldrModel(SignatureSpec(np.ones((1, 2)), (0,)), normalize(np.eye(2)), ("d0", "d1"))


def eldr() -> Eldr:
    return Eldr(EldrParams(artifact="-", pd=True), MODEL)


def spec_of(policy: Eldr) -> PrefillSignature:
    """The prefill stage the policy declares (PD mode)."""
    [spec] = policy.stages()
    assert isinstance(spec, PrefillSignature)
    return spec


class SideEndpoint:
    """The plugin's side endpoint, served over a real socket (the stage reads it
    with aiohttp); `fail` answers 404 as the plugin does for an unknown request."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.fail = False
        self.url = ""

    async def record(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        if self.fail:
            return web.json_response({"error": "unknown request"}, status=404)
        return web.json_response({"prefill": [[1, 9]], "decode": [[0, 0]]})

    def view(self) -> ClusterView:
        """A prefill backend p0 whose plugin is this endpoint, and the decoders."""
        prefill = Backend("p0", "http://p0", "m", MappingProxyType(
            {"role": "prefill", "eldr_url": self.url}))
        return ClusterView((prefill, *DECODERS), {}, {}, 0.0)


@pytest.fixture
async def side() -> AsyncIterator[SideEndpoint]:
    endpoint = SideEndpoint()
    app = web.Application()
    app.router.add_get("/eldr/requests/{request_id}", endpoint.record)
    server = TestServer(app)
    await server.start_server()
    endpoint.url = str(server.make_url("")).rstrip("/")
    yield endpoint
    await server.close()


def transport(seen: list[httpx.Request]) -> httpx.MockTransport:
    """The prefill backend p0: answers the leg."""
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"choices": [{"text": "x"}]})
    return httpx.MockTransport(handle)


async def test_prefill_leg_yields_the_signature_and_decode_avoids_the_prefill_pool(
        side: SideEndpoint) -> None:
    seen: list[httpx.Request] = []
    policy = eldr()
    stage = PrefillStage(spec_of(policy), transport=transport(seen))
    context = ctx(request_id="req-1")
    view = side.view()
    pred = await stage.predict(context, {"model": "m", "prompt": "hi", "max_tokens": 50,
                                         "stream": True}, NO_PREDICTION, view)
    await stage.close()
    [leg] = seen
    assert json.loads(leg.content) == {"model": "m", "prompt": "hi", "max_tokens": 1,
                                       "stream": False}
    assert leg.headers["X-Request-Id"] == "req-1"
    assert side.paths == ["/eldr/requests/req-1"]
    assert pred.expert_signature is not None
    assert np.allclose(pred.expert_signature, normalize(np.array([1.0, 9.0])))
    assert policy.pick(context, pred, view).backend.name == "d1"
    assert policy.pick(context, NO_PREDICTION, view).backend.name in {"d0", "d1"}


async def test_the_prefill_leg_names_what_the_request_names_on_that_backend(
        side: SideEndpoint) -> None:
    """A LoRA adapter's request prefills with the adapter (its KV and experts are the
    adapter's, as its decode's will be); a group's with the member the backend serves."""
    seen: list[httpx.Request] = []
    view = side.view()
    registry = Registry(view.candidates, {"fleet": ["other", "m"]})
    registry.set_served("p0", ["m", "m-sql"])
    stage = PrefillStage(spec_of(eldr()), transport=transport(seen), model_on=registry.model_on)
    for requested in ("m-sql", "fleet", "m"):
        await stage.predict(dataclasses.replace(ctx(), model=requested),
                            {"model": requested, "prompt": "hi"}, NO_PREDICTION, view)
    await stage.close()
    assert [json.loads(leg.content)["model"] for leg in seen] == ["m-sql", "m", "m"]


async def test_a_failed_lookup_leaves_the_prediction_without_a_signature(
        side: SideEndpoint, caplog: pytest.LogCaptureFixture) -> None:
    side.fail = True
    stage = PrefillStage(spec_of(eldr()), transport=transport([]))
    with caplog.at_level(logging.WARNING, "laneway"):
        pred = await stage.predict(ctx(request_id="req-3"), {"prompt": "hi"},
                                   NO_PREDICTION, side.view())
    await stage.close()
    assert pred is NO_PREDICTION
    assert "request req-3: no ELDR signature" in caplog.text and "404" in caplog.text


async def test_a_side_endpoint_that_does_not_answer_leaves_no_signature() -> None:
    gone = Backend("p0", "http://p0", "m", MappingProxyType(
        {"role": "prefill", "eldr_url": "http://127.0.0.1:9"}))  # discard: refused
    stage = PrefillStage(spec_of(eldr()), transport=transport([]))
    pred = await stage.predict(ctx(), {"prompt": "hi"}, NO_PREDICTION,
                               ClusterView((gone, *DECODERS), {}, {}, 0.0))
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
    stage = PrefillStage(spec_of(eldr()), transport=httpx.MockTransport(handle))
    view = ClusterView((gpu_prefill, *DECODERS), {}, {}, 0.0)
    pred = await stage.predict(ctx(), {"prompt": "hi"}, NO_PREDICTION, view)
    await stage.close()
    assert len(seen) == 1 and pred.expert_signature is not None
    assert np.allclose(pred.expert_signature, normalize(np.array([2.0, 4.0])))


HANDLE = {"do_remote_prefill": True, "do_remote_decode": False,
          "remote_block_ids": [[3, 4]], "remote_engine_id": "p0-engine",
          "remote_request_id": "cmpl-req-1-0", "remote_host": "10.0.0.5",
          "remote_port": 5600, "tp_size": 1}


def kv_stage(seen: list[httpx.Request], handle: dict[str, Any] | None,
             leg_status: int = 200) -> PrefillStage:
    """A kv_transfer stage over a prefill backend that returns `handle` (vLLM puts it
    at the top level of the response); the counts come from the `side` endpoint."""
    def handle_request(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(leg_status, json={"choices": [{"text": "x"}],
                                                "kv_transfer_params": handle})
    policy = Eldr(EldrParams(artifact="-", pd=True, kv_transfer=True), MODEL)
    return PrefillStage(spec_of(policy), transport=httpx.MockTransport(handle_request))


async def test_kv_transfer_asks_the_prefill_leg_to_keep_its_kv_and_returns_the_handle(
        side: SideEndpoint) -> None:
    seen: list[httpx.Request] = []
    stage = kv_stage(seen, HANDLE)
    pred = await stage.predict(ctx(), {"model": "m", "prompt": "hi", "max_tokens": 50,
                                       "min_tokens": 10, "stream": True,
                                       "stream_options": {"include_usage": True}},
                               NO_PREDICTION, side.view())
    await stage.close()
    assert json.loads(seen[0].content) == {
        "model": "m", "prompt": "hi", "max_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                               "remote_engine_id": None, "remote_block_ids": None,
                               "remote_host": None, "remote_port": None}}
    assert handle_of(pred) == HANDLE
    assert pred.expert_signature is not None  # the signature is read as before


async def test_kv_transfer_off_leaves_the_leg_and_the_prediction_as_they_were(
        side: SideEndpoint) -> None:
    seen: list[httpx.Request] = []
    stage = PrefillStage(spec_of(eldr()), transport=transport(seen))
    pred = await stage.predict(ctx(), {"prompt": "hi"}, NO_PREDICTION, side.view())
    await stage.close()
    assert "kv_transfer_params" not in json.loads(seen[0].content)
    assert handle_of(pred) is None and pred.expert_signature is not None


@pytest.mark.parametrize(("handle", "status"), [(None, 200), ({}, 200), (HANDLE, 500)],
                         ids=["null", "empty", "leg-failed"])
async def test_no_handle_from_the_prefill_leg_means_the_decode_prefills_again(
        handle: dict[str, Any] | None, status: int, caplog: pytest.LogCaptureFixture,
        side: SideEndpoint) -> None:
    stage = kv_stage([], handle, leg_status=status)
    with caplog.at_level(logging.WARNING, "laneway"):
        pred = await stage.predict(ctx(request_id="req-2"), {"prompt": "hi"},
                                   NO_PREDICTION, side.view())
    await stage.close()
    assert handle_of(pred) is None
    assert "request req-2" in caplog.text and "prefills again" in caplog.text


async def test_a_signature_lookup_failure_keeps_the_handle() -> None:
    def handle_request(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"text": "x"}],
                                         "kv_transfer_params": HANDLE})
    gpu_prefill = Backend("p0", "http://p0", "m", MappingProxyType({"role": "prefill"}))
    policy = Eldr(EldrParams(artifact="-", pd=True, kv_transfer=True), MODEL)
    stage = PrefillStage(spec_of(policy), transport=httpx.MockTransport(handle_request))
    pred = await stage.predict(ctx(), {"prompt": "hi"}, NO_PREDICTION,
                               ClusterView((gpu_prefill, *DECODERS), {}, {}, 0.0))
    await stage.close()
    assert pred.expert_signature is None and handle_of(pred) == HANDLE


def test_kv_transfer_needs_pd_mode() -> None:
    with pytest.raises(ValidationError, match="kv_transfer"):
        EldrParams(artifact="-", kv_transfer=True)
    assert EldrParams(artifact="-", pd=True, kv_transfer=True).kv_transfer
