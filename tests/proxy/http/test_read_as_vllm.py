"""Requests read as vLLM reads them, so that what vLLM answers, the proxy answers.

A request that names no model: vLLM fills in its served model when `model` is absent,
null or "" (chat, completions, Responses, /tokenize, embeddings; not the Messages API,
whose schema requires one). The proxy does the same with `server.default_model`, or,
unset, with the fleet's model if it serves exactly one; the body sent upstream then
names it. And the fields the proxy reads, in pydantic's lax spellings (`"max_tokens":
"8"`, `"stream": "true"`), are read as vLLM reads them and sent on written as read.
Both found by the differential fuzz against real vLLM
(tests/integration/test_fuzz_vllm.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.fakes.fake_vllm import FakeConfig
from tests.proxy.fakes import fleet, post

ASK: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "model": None}),
    ("/v1/responses", {"input": "x", "max_output_tokens": 2, "model": ""}),
    ("/v1/embeddings", {"input": "x"}),
]


@pytest.mark.parametrize(("path", "body"), ASK)
async def test_the_fleets_one_model_answers_a_request_that_names_none(
        path: str, body: dict[str, Any]) -> None:
    async with fleet(FakeConfig()) as (proxy, fakes):
        answer = await post(proxy, body, path)
    assert answer.status_code == 200, answer.text
    assert fakes[0].app.stats.bodies[-1]["model"] == "fake"  # the body names it upstream


async def test_with_several_models_it_is_a_400_unless_a_default_is_set() -> None:
    two = (FakeConfig(), FakeConfig(model="other"))
    async with fleet(*two) as (proxy, fakes):
        refused = [await post(proxy, body, path) for path, body in ASK]
    assert [r.status_code for r in refused] == [400] * len(ASK)
    assert {r.json()["error"]["param"] for r in refused} == {"model"}
    assert "server.default_model" in refused[0].json()["error"]["message"]
    assert [f.app.stats.requests for f in fakes] == [0, 0]
    async with fleet(*two, server={"default_model": "other"}) as (proxy, fakes):
        routed = [await post(proxy, body, path) for path, body in ASK]
    assert [r.status_code for r in routed] == [200] * len(ASK)
    assert [r.headers["x-laneway-backend"] for r in routed] == ["f1"] * len(ASK)
    assert {b["model"] for b in fakes[1].app.stats.bodies} == {"other"}


async def test_a_model_group_is_one_more_name_to_choose_from() -> None:
    async with fleet(FakeConfig(), model_groups={"team": ["fake"]}) as (proxy, _):
        answer = await post(proxy, ASK[0][1])
    assert answer.status_code == 400


async def test_the_messages_api_still_needs_its_model() -> None:
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with fleet(FakeConfig()) as (proxy, fakes):
        refused = [await post(proxy, ask, path)
                   for path in ("/v1/messages", "/v1/messages/count_tokens")]
    assert [r.status_code for r in refused] == [400, 400]
    assert [r.json()["type"] for r in refused] == ["error", "error"]  # Anthropic's shape
    assert fakes[0].app.stats.requests == 0


async def test_a_model_that_is_not_a_string_is_a_400_default_or_not() -> None:
    async with fleet(FakeConfig()) as (proxy, _):
        answer = await post(proxy, {**ASK[0][1], "model": 5})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "model"


async def test_lax_spellings_are_read_as_vllm_reads_them_and_sent_on_as_read() -> None:
    ask = {"model": "fake", "messages": [{"role": "user", "content": "hi"}],
           "max_tokens": "3", "stream": "true"}
    async with fleet(FakeConfig()) as (proxy, fakes):
        answer = await post(proxy, ask)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert answer.text.count("\"content\":\"tok") == 3 and answer.text.rstrip().endswith("[DONE]")
    sent = fakes[0].app.stats.bodies[-1]
    assert (sent["max_tokens"], sent["stream"]) == (3, True)
