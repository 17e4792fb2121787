"""The fake vLLM server: wire shapes, accounting, metrics and injected failures."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest

from bench.fakes.fake_metrics import PREFIX_BLOCK
from bench.fakes.fake_vllm import FakeConfig, RunningFake, serve_fake
from bench.fakes.fake_wire import GEN_BASE

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hello there"}]}


def events(text: str) -> list[Any]:
    data = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [orjson.loads(d) for d in data[:-1]]


async def post(fake: RunningFake, body: dict[str, Any], path: str = "/v1/chat/completions",
               **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=fake.url, timeout=10) as http:
        return await http.post(path, json=body, **kw)


def metric(text: str, sample: str) -> float:
    """The value of one sample line, e.g. `vllm:num_requests_running{...}`."""
    for line in text.splitlines():
        if line.startswith(sample):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(sample)


async def test_chat_stream_has_role_event_then_one_event_per_token() -> None:
    async with serve_fake(FakeConfig(model="m")) as fake:
        response = await post(fake, {**CHAT, "model": "m", "stream": True, "max_tokens": 5},
                              headers={"x-request-id": "abc"})
    chunks = events(response.text)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:]] == [
        f"tok{i} " for i in range(5)]
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:]] == [None] * 4 + ["length"]
    assert {(c["id"], c["object"], c["model"]) for c in chunks} == {
        ("chatcmpl-abc", "chat.completion.chunk", "m")}


async def test_usage_event_and_stop_without_max_tokens() -> None:
    async with serve_fake(FakeConfig(default_tokens=7)) as fake:
        response = await post(fake, {**CHAT, "stream": True,
                                     "stream_options": {"include_usage": True}})
    chunks = events(response.text)
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 7,
                                   "total_tokens": 10}


async def test_length_bounds_are_read_as_vllm_reads_them() -> None:
    async with serve_fake(FakeConfig(default_tokens=7)) as fake:
        completion = await post(fake, {"model": CHAT["model"], "prompt": "a b",
                                       "max_completion_tokens": 4}, "/v1/completions")
        chat = await post(fake, {**CHAT, "max_tokens": 3, "max_completion_tokens": 5})
    assert completion.json()["usage"]["completion_tokens"] == 16  # vLLM's default
    assert completion.json()["choices"][0]["finish_reason"] == "length"
    assert chat.json()["usage"]["completion_tokens"] == 5


async def test_ignore_eos_reaches_max_tokens() -> None:
    async with serve_fake(FakeConfig(eos_after=3)) as fake:
        natural = await post(fake, {**CHAT, "max_tokens": 10})
        forced = await post(fake, {**CHAT, "max_tokens": 10, "ignore_eos": True})
    assert natural.json()["usage"]["completion_tokens"] == 3
    assert natural.json()["choices"][0]["finish_reason"] == "stop"
    assert forced.json()["usage"]["completion_tokens"] == 10
    assert forced.json()["choices"][0]["finish_reason"] == "length"


async def test_non_stream_bodies() -> None:
    async with serve_fake(FakeConfig()) as fake:
        chat = await post(fake, {**CHAT, "max_tokens": 3})
        text = await post(fake, {"model": "fake", "prompt": "a b", "max_tokens": 2},
                          "/v1/completions")
        stats = fake.app.stats
    assert chat.json()["object"] == "chat.completion"
    assert chat.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
    assert chat.json()["usage"]["completion_tokens"] == 3
    assert text.json()["choices"][0]["text"] == "tok0 tok1 "
    assert text.json()["id"].startswith("cmpl-")
    assert stats.requests == 2 and stats.finished == 2
    assert stats.last_body == {"model": "fake", "prompt": "a b", "max_tokens": 2}


async def test_token_ids_continue_a_migrated_sequence() -> None:
    async with serve_fake(FakeConfig()) as fake:
        first = events((await post(fake, {"model": "fake", "prompt": "x y", "max_tokens": 3,
                                          "stream": True, "return_token_ids": True},
                                    "/v1/completions")).text)
        prompt_ids = first[0]["choices"][0]["prompt_token_ids"]
        generated = [c["choices"][0]["token_ids"][0] for c in first]
        resumed = events((await post(fake, {"model": "fake", "prompt": prompt_ids + generated,
                                            "max_tokens": 2, "stream": True,
                                            "return_token_ids": True},
                                     "/v1/completions")).text)
    assert len(prompt_ids) == 3 and generated == [GEN_BASE, GEN_BASE + 1, GEN_BASE + 2]
    assert [c["choices"][0]["text"] for c in resumed] == ["tok3 ", "tok4 "]
    assert resumed[0]["choices"][0]["prompt_token_ids"] == prompt_ids + generated


async def test_unknown_model_is_404() -> None:
    async with serve_fake(FakeConfig(aliases=("alias",))) as fake:
        missing = await post(fake, {**CHAT, "model": "other"})
        alias = await post(fake, {**CHAT, "model": "alias", "max_tokens": 1})
        async with httpx.AsyncClient() as http:
            models = (await http.get(f"{fake.url}/v1/models")).json()
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert alias.status_code == 200
    assert [m["id"] for m in models["data"]] == ["fake", "alias"]


async def test_metrics_follow_a_disconnected_stream_down_to_zero() -> None:
    async with serve_fake(FakeConfig(tpot_s=0.01)) as fake, httpx.AsyncClient() as http:
        body = {**CHAT, "stream": True, "max_tokens": 1000}
        async with http.stream("POST", f"{fake.url}/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if "tok3 " in line:
                    during = (await http.get(f"{fake.url}/metrics")).text
                    break
        for _ in range(200):  # the server sees the disconnect asynchronously
            after = (await http.get(f"{fake.url}/metrics")).text
            if metric(after, "vllm:num_requests_running{") == 0:
                break
            await asyncio.sleep(0.005)
        stats = fake.app.stats
    labels = '{engine="0",model_name="fake"}'
    assert metric(during, f"vllm:num_requests_running{labels}") == 1
    assert metric(after, f"vllm:num_requests_running{labels}") == 0
    assert stats.cancelled == 1 and stats.finished == 0 and stats.kv_tokens == 0
    assert metric(after, f"vllm:time_to_first_token_seconds_count{labels}") == 1
    itl_count = metric(after, f"vllm:inter_token_latency_seconds_count{labels}")
    assert itl_count >= 3
    assert metric(after, 'vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",'
                         'model_name="fake"}') == itl_count
    assert metric(after, 'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",'
                         'model_name="fake"}') < itl_count  # paced at >= 10 ms
    assert "# TYPE vllm:prefix_cache_queries_total counter" in after


async def test_prefix_cache_counts_repeated_prompt_blocks() -> None:
    long_prompt = " ".join(f"w{i}" for i in range(2 * PREFIX_BLOCK))
    body = {"model": "fake", "prompt": long_prompt, "max_tokens": 1}
    async with serve_fake(FakeConfig()) as fake:
        await post(fake, body, "/v1/completions")
        await post(fake, body, "/v1/completions")
        stats = fake.app.stats
    assert stats.prefix_queries == 2 * (2 * PREFIX_BLOCK + 1)  # + BOS
    assert stats.prefix_hits == 2 * PREFIX_BLOCK


async def test_requests_beyond_max_num_seqs_wait() -> None:
    async with serve_fake(FakeConfig(tpot_s=0.01, max_num_seqs=1)) as fake:
        calls = [asyncio.create_task(post(fake, {**CHAT, "max_tokens": 10})) for _ in range(3)]
        for _ in range(200):
            if fake.app.stats.waiting == 2:
                break
            await asyncio.sleep(0.005)
        assert (fake.app.stats.running, fake.app.stats.waiting) == (1, 2)
        await asyncio.gather(*calls)
        assert (fake.app.stats.running, fake.app.stats.waiting) == (0, 0)


@pytest.mark.parametrize("stream", [True, False])
async def test_die_after_tokens_breaks_the_connection(stream: bool) -> None:
    async with serve_fake(FakeConfig(die_after_tokens=3)) as fake, httpx.AsyncClient() as http:
        received: list[bytes] = []
        with pytest.raises(httpx.RemoteProtocolError):
            async with http.stream("POST", f"{fake.url}/v1/chat/completions",
                                   json={**CHAT, "stream": stream, "max_tokens": 10}) as r:
                assert r.status_code == 200
                async for chunk in r.aiter_bytes():
                    received.append(chunk)
        assert fake.app.stats.dropped == 1 and fake.app.stats.running == 0
    if stream:
        assert b"".join(received).count(b'"content":"tok') == 3


async def test_fail_status_for_the_first_requests_only() -> None:
    async with serve_fake(FakeConfig(fail_status=503, fail_first=2)) as fake:
        statuses = [(await post(fake, {**CHAT, "max_tokens": 1})).status_code for _ in range(3)]
        assert fake.app.stats.requests == 3
    assert statuses == [503, 503, 200]


async def test_hang_never_answers_and_is_cancelled_on_disconnect() -> None:
    async with serve_fake(FakeConfig(hang=True)) as fake:
        with pytest.raises(httpx.ReadTimeout):
            async with httpx.AsyncClient(timeout=0.2) as http:
                await http.post(f"{fake.url}/v1/chat/completions", json=CHAT)
        for _ in range(200):
            if fake.app.stats.cancelled:
                break
            await asyncio.sleep(0.005)
        assert fake.app.stats.cancelled == 1 and fake.app.stats.finished == 0


async def test_health_and_unknown_path() -> None:
    async with serve_fake(FakeConfig()) as fake, httpx.AsyncClient(base_url=fake.url) as http:
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/v1/files")).status_code == 404


async def test_metrics_honour_the_name_filter_like_prometheus_client() -> None:
    wanted = ["vllm:num_requests_running", "vllm:prefix_cache_hits_total",
              "vllm:time_to_first_token_seconds_sum"]
    async with serve_fake(FakeConfig(model="m")) as fake, httpx.AsyncClient() as http:
        await http.post(f"{fake.url}/v1/chat/completions", json={**CHAT, "model": "m"})
        full = (await http.get(f"{fake.url}/metrics")).text
        some = (await http.get(f"{fake.url}/metrics", params={"name[]": wanted})).text
    samples = {line.split("{")[0] for line in some.splitlines() if not line.startswith("#")}
    assert samples == set(wanted)
    for line in some.splitlines():
        assert line in full.splitlines()  # same lines, fewer of them
    assert len(some) < len(full) / 3
