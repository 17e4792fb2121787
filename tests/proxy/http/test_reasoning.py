"""Streams of a server with a reasoning parser: the reasoning deltas reach the client as
vLLM sends them, and such a stream stays on its backend (a continuation is a raw
completion, which would come back without the parser's split)."""

from __future__ import annotations

import logging
from typing import Any

import orjson
import pytest

from bench.fakes.fake_vllm import FakeConfig
from tests.proxy.fakes import CHAT, events, fleet, post

FORCED = {"debug": {"allow_forced_migration": True}}
THINKS = FakeConfig(reasoning_tokens=3, tpot_s=0.01)


def deltas(text: str) -> list[dict[str, Any]]:
    return [orjson.loads(e)["choices"][0]["delta"] for e in events(text) if e != "[DONE]"]


def joined(parts: list[dict[str, Any]], key: str) -> str:
    return "".join(d.get(key) or "" for d in parts)


async def test_reasoning_deltas_are_relayed_as_vllm_sends_them() -> None:
    body = {**CHAT, "stream": True, "max_tokens": 6}
    async with fleet(THINKS) as (proxy, fakes):
        response = await post(proxy, body)
        direct = await post(fakes[0], body)  # type: ignore[arg-type]
    got, want = deltas(response.text), deltas(direct.text)
    assert got == want
    assert joined(got, "reasoning") == "tok0 tok1 tok2 "
    assert joined(got, "content") == "tok3 tok4 tok5 "
    assert {"reasoning": "tok0 "} in got  # reasoning-only deltas carry no content


@pytest.mark.parametrize("greedy", [True, False], ids=["paced", "frozen"])
async def test_a_reasoning_stream_is_not_moved(greedy: bool,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """A move asked at token 0 starts before the first delta (the backend is new); the
    first reasoning delta ends it. Later streams on that backend do not start one."""
    caplog.set_level(logging.INFO, logger="laneway")
    slow_start = FakeConfig(reasoning_tokens=3, tpot_s=0.01, ttft_s=0.3)
    body = {**CHAT, "stream": True, "max_tokens": 8, **({"temperature": 0} if greedy else {})}
    forced = {"x-laneway-migrate-after": "0", "x-laneway-events": "1"}
    async with fleet(THINKS, slow_start, **FORCED) as (proxy, fakes):
        response = await post(proxy, body, headers=forced)
        for _ in range(2):  # round robin: both backends have streamed reasoning now
            await post(proxy, {**CHAT, "stream": True, "max_tokens": 1})
        again = await post(proxy, body, headers=forced)
    for answer in (response, again):
        assert ": laneway" not in answer.text  # no move
        got = deltas(answer.text)
        assert joined(got, "reasoning") == "tok0 tok1 tok2 "
        assert joined(got, "content") == "tok3 tok4 tok5 tok6 tok7 "
    lines = [r.getMessage() for r in caplog.records]
    assert sum(": moving f0 -> f1 after 0 tokens (forced)" in line for line in lines) == 1
    assert any("f0 streams reasoning; the stream stays there" in line for line in lines)
    if greedy:
        assert any("paced handoff to f1 abandoned (the source streams reasoning)" in line
                   for line in lines)
    assert not any(": now on f1" in line for line in lines)
    assert fakes[0].app.stats.finished + fakes[1].app.stats.finished == 4  # no continuation


async def test_a_whole_answer_keeps_its_reasoning() -> None:
    body = {**CHAT, "max_tokens": 5}
    async with fleet(THINKS, migration={"non_stream": True}) as (proxy, fakes):
        response = await post(proxy, body)
        direct = await post(fakes[0], body)  # type: ignore[arg-type]
        only_reasoning = await post(proxy, {**body, "max_tokens": 2})
    message = response.json()["choices"][0]["message"]
    assert message["reasoning"] == direct.json()["choices"][0]["message"]["reasoning"] \
        == "tok0 tok1 tok2 "
    assert message["content"] == "tok3 tok4 "
    assert only_reasoning.json()["choices"][0]["message"]["content"] is None


async def test_a_backend_failing_mid_reasoning_ends_the_stream_with_an_error() -> None:
    dying = FakeConfig(reasoning_tokens=5, die_after_tokens=2)
    async with fleet(dying, FakeConfig(reasoning_tokens=5)) as (proxy, fakes):
        response = await post(proxy, {**CHAT, "stream": True, "max_tokens": 8})
    data = events(response.text)
    assert "error" in orjson.loads(data[-2])
    assert fakes[1].app.stats.requests == 0  # not continued where the split would be lost


async def test_a_backend_seen_reasoning_gets_its_requests_as_the_client_sent_them() -> None:
    """Its streams stay anyway; relayed untracked, its own bytes are the answer (a
    stop string inside the reasoning ends it as the server ends it)."""
    body = {**CHAT, "stream": True, "max_tokens": 4, "stop": ["x"]}
    async with fleet(THINKS) as (proxy, fakes):
        first = await post(proxy, body)  # tracked: the proxy learns the backend reasons
        second = await post(proxy, body)
        direct = await post(fakes[0], body)  # type: ignore[arg-type]
    tracked, relayed = fakes[0].app.stats.bodies[:2]
    assert tracked["return_token_ids"] and tracked["include_stop_str_in_output"]
    assert relayed == body  # untouched
    assert second.text == direct.text and deltas(first.text) == deltas(direct.text)
