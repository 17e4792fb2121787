"""The Anthropic Messages API (`/v1/messages`) through the proxy, driven by the
official `anthropic` SDK: routed by the policy, streams relayed to `message_stop`,
errors in Anthropic's shape, `x-api-key` accepted as the key."""

from __future__ import annotations

import anthropic
import pytest

from bench.fakes.fake_vllm import FakeConfig
from tests.proxy.admission.test_auth import keys
from tests.proxy.fakes import charged, fleet, post

ASK = {"model": "fake", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


def sdk(url: str, key: str = "sk-alice") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0, timeout=10)


async def test_the_sdk_gets_whole_and_streamed_messages() -> None:
    async with fleet(FakeConfig(tpot_s=0.001), FakeConfig(tpot_s=0.001),
                     auth=keys(tokens_per_minute=10_000)) as (proxy, fakes):
        rt = proxy.app.runtime
        assert rt is not None
        client = sdk(proxy.url)
        raw = await client.messages.with_raw_response.create(
            model="fake", max_tokens=5, system="Be brief.",
            messages=[{"role": "user", "content": "hi"}])
        whole = await raw.parse()
        async with client.messages.stream(
                model="fake", max_tokens=4,
                messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
        ) as stream:
            texts = [text async for text in stream.text_stream]
            final = await stream.get_final_message()
        used = charged(rt.auth.limiter, "alice:tokens")
        metrics = rt.metrics.render().decode()
    assert whole.content[0].text == "tok0 tok1 tok2 tok3 tok4 "  # type: ignore[union-attr]
    assert raw.headers["x-laneway-backend"] in ("f0", "f1")
    assert fakes[0].app.stats.requests + fakes[1].app.stats.requests == 2
    assert "".join(texts) == "tok0 tok1 tok2 tok3 "
    assert final.usage.output_tokens == 4
    # Charged what the backends reported: input + output of both.
    assert used == pytest.approx(whole.usage.input_tokens + whole.usage.output_tokens
                                 + final.usage.input_tokens + 4, abs=1e-3)
    assert 'status="200"} 1.0' in metrics


async def test_a_stream_cut_mid_way_ends_with_an_anthropic_error_event() -> None:
    async with fleet(FakeConfig(die_after_tokens=2)) as (proxy, _):
        answer = await post(proxy, {**ASK, "stream": True}, "/v1/messages")
        with pytest.raises(anthropic.APIStatusError):
            async with sdk(proxy.url).messages.stream(**ASK) as stream:  # type: ignore[arg-type]
                async for _ in stream.text_stream:
                    pass
    events = answer.text.strip().split("\n\n")
    assert events[-1].startswith("event: error\ndata: ")
    assert '{"type":"error","error":{"type":"api_error","message":"Backend f0 failed' \
        in events[-1]
    assert sum("content_block_delta" in e for e in events) == 2


@pytest.mark.parametrize(
    ("body", "headers", "status", "kind"),
    [
        ({**ASK, "model": 5}, {}, 400, "invalid_request_error"),
        ({**ASK, "stream": "maybe"}, {}, 400, "invalid_request_error"),
        ({**ASK, "max_tokens": 0}, {}, 400, "invalid_request_error"),
        ({**ASK, "model": "nope"}, {}, 404, "not_found_error"),
        (ASK, {"x-api-key": "sk-mallory"}, 401, "authentication_error"),
        (ASK, {"x-api-key": "sk-bob"}, 403, "permission_error"),
    ],
)
async def test_errors_are_in_anthropics_shape(
        body: dict[str, object], headers: dict[str, str], status: int, kind: str) -> None:
    async with fleet(FakeConfig(), auth=keys()) as (proxy, fakes):
        answer = await post(proxy, body, "/v1/messages",
                            headers=headers or {"x-api-key": "sk-alice"})
    assert answer.status_code == status
    error = answer.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == kind
    assert fakes[0].app.stats.requests == 0


async def test_count_tokens_reaches_a_backend_of_the_model() -> None:
    async with fleet(FakeConfig()) as (proxy, _):
        counted = await sdk(proxy.url).messages.count_tokens(
            model="fake", messages=[{"role": "user", "content": "one two three"}])
    assert counted.input_tokens == 4  # BOS + three words, as the fake counts
