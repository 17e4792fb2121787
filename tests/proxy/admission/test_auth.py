"""API keys, per-key models and rate limits, through the proxy and in isolation."""

from __future__ import annotations

import httpx
import pytest

from bench.fakes.fake_vllm import FakeConfig
from proxy.admission.auth import Auth
from proxy.config import AuthConfig
from proxy.errors import RateLimited
from proxy.hashing import hash_key
from proxy.state.rate_counters import RateLimiter, WindowCounters
from proxy.types import Outcome, RequestContext
from tests.proxy.fakes import CHAT, charged, fleet, post


def keys(**limits: object) -> dict[str, object]:
    return {"enabled": True, "keys": [
        {"name": "alice", "sha256": hash_key("sk-alice"), **limits},
        {"name": "bob", "sha256": hash_key("sk-bob"), "models": ["other"]},
    ]}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_missing_or_wrong_key_is_401_in_openai_shape() -> None:
    async with fleet(FakeConfig(), auth=keys()) as (proxy, fakes):
        missing = await post(proxy, CHAT)
        wrong = await post(proxy, CHAT, headers=bearer("sk-mallory"))
        good = await post(proxy, CHAT, headers=bearer("sk-alice"))
    assert (missing.status_code, wrong.status_code, good.status_code) == (401, 401, 200)
    assert wrong.json() == {"error": {"message": "Incorrect API key provided.",
                                      "type": "invalid_request_error", "param": None,
                                      "code": "invalid_api_key"}}
    assert fakes[0].app.stats.bodies == [CHAT]  # only the good request got through


async def test_key_limited_to_models_gets_403_and_sees_only_its_models() -> None:
    async with fleet(FakeConfig(), FakeConfig(model="other"), auth=keys()) as (proxy, _):
        denied = await post(proxy, CHAT, headers=bearer("sk-bob"))
        allowed = await post(proxy, {**CHAT, "model": "other"}, headers=bearer("sk-bob"))
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            bob = (await http.get("/v1/models", headers=bearer("sk-bob"))).json()
            alice = (await http.get("/v1/models", headers=bearer("sk-alice"))).json()
            anonymous = await http.get("/v1/models")
    assert denied.status_code == 403
    assert denied.json()["error"]["code"] == "model_not_allowed"
    assert denied.json()["error"]["param"] == "model"
    assert allowed.status_code == 200
    assert [m["id"] for m in bob["data"]] == ["other"]
    assert [m["id"] for m in alice["data"]] == ["fake", "other"]
    assert anonymous.status_code == 401


async def test_requests_per_minute_gives_429_with_retry_after() -> None:
    async with fleet(FakeConfig(), auth=keys(requests_per_minute=3)) as (proxy, _):
        statuses = [(await post(proxy, CHAT, headers=bearer("sk-alice"))).status_code
                    for _ in range(3)]
        limited = await post(proxy, CHAT, headers=bearer("sk-alice"))
        other_key = await post(proxy, {**CHAT, "model": "fake"}, headers=bearer("sk-bob"))
    assert statuses == [200, 200, 200]
    assert limited.status_code == 429
    error = limited.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert 1 <= int(limited.headers["retry-after"]) <= 120
    assert other_key.status_code == 403  # bob's limit is his own; his models still apply


async def test_tokens_charged_up_front_then_reconciled_with_usage() -> None:
    # The fake ends after 5 tokens whatever max_tokens says, so the real usage is far
    # below the up-front charge; only a reconciled window admits the third request.
    async with fleet(FakeConfig(eos_after=5), auth=keys(tokens_per_minute=120)) as (
            proxy, _):
        rt = proxy.app.runtime
        assert rt is not None
        first = await post(proxy, {**CHAT, "max_tokens": 100}, headers=bearer("sk-alice"))
        used = charged(rt.auth.limiter, "alice:tokens")
        usage = first.json()["usage"]
        second = await post(proxy, {**CHAT, "max_tokens": 100}, headers=bearer("sk-alice"))
        too_big = await post(proxy, {**CHAT, "max_tokens": 119}, headers=bearer("sk-alice"))
    assert first.status_code == 200
    assert used == pytest.approx(usage["prompt_tokens"] + usage["completion_tokens"], abs=1e-3)
    assert second.status_code == 200
    assert too_big.status_code == 429
    assert too_big.json()["error"]["type"] == "tokens"


def _ctx(prompt: str, max_tokens: int | None) -> RequestContext:
    return RequestContext("r1", "chat", "fake", prompt, (), False, max_tokens)


def test_refund_when_no_backend_answered() -> None:
    clock = [1000.0]
    auth = Auth(AuthConfig.model_validate(keys(tokens_per_minute=1000)), WindowCounters(),
                clock=lambda: clock[0])
    grant = auth.admit(bearer("sk-alice"), _ctx("x" * 40, 50))
    assert grant is not None and grant.charged_tokens == 10 + 50
    assert auth.limiter.used("alice:tokens", clock[0]) == 60
    auth.settle(grant, None)
    assert auth.limiter.used("alice:tokens", clock[0]) == 0
    grant = auth.admit(bearer("sk-alice"), _ctx("x" * 40, None))  # default_max_tokens
    assert grant is not None and grant.charged_tokens == 10 + 256
    auth.settle(grant, Outcome("r1", "fake", "f0", "p", 200, True, 0.0, 0.1, 0.2,
                               completion_tokens=7, prompt_tokens=12))
    assert auth.limiter.used("alice:tokens", clock[0]) == 19


def test_sliding_window_and_retry_after() -> None:
    limiter = RateLimiter(WindowCounters())
    start = 600.0  # the start of window 10
    for _ in range(10):
        limiter.charge("k:requests", 1, 10)
    assert limiter.retry_after("k:requests", 1, 10, start + 30) == 30 + 6  # 10*(1-f)+1 <= 10
    assert limiter.used("k:requests", start + 60 + 15) == pytest.approx(7.5)  # next window
    assert limiter.retry_after("k:requests", 1, 10, start + 75) is None
    assert limiter.retry_after("k:requests", 11, 10, start) == 120  # never fits


def test_store_keys_are_accepted_and_bad_ones_skipped() -> None:
    auth = Auth(AuthConfig(enabled=True), WindowCounters())
    auth.set_store_keys({hash_key("sk-redis"): {"name": "carol", "models": ["fake"]},
                         hash_key("sk-bad"): {"models": "not a list"}})
    key = auth.key_of(bearer("sk-redis"))
    assert key is not None and key.name == "carol" and key.allows("fake")
    with pytest.raises(Exception, match="Incorrect API key"):
        auth.key_of(bearer("sk-bad"))
    with pytest.raises(RateLimited):
        limited = Auth(AuthConfig.model_validate(keys(requests_per_minute=1)),
                       WindowCounters())
        for _ in range(2):
            limited.admit(bearer("sk-alice"), _ctx("hi", 1))


async def test_answers_carry_the_keys_limits_and_whats_left() -> None:
    """OpenAI's x-ratelimit-* headers, so that clients can pace themselves."""
    async with fleet(FakeConfig(), auth=keys(requests_per_minute=5,
                                             tokens_per_minute=1000)) as (proxy, _):
        first = await post(proxy, {**CHAT, "max_tokens": 10}, headers=bearer("sk-alice"))
        streamed = await post(proxy, {**CHAT, "max_tokens": 10, "stream": True},
                              headers=bearer("sk-alice"))
        embedded = await post(proxy, {"model": "fake", "input": "x"}, "/v1/embeddings",
                              headers=bearer("sk-alice"))
        unlimited = await post(proxy, {**CHAT, "model": "other"}, headers=bearer("sk-bob"))
    assert first.status_code == streamed.status_code == embedded.status_code == 200
    assert [r.headers["x-ratelimit-limit-requests"] for r in (first, streamed)] == ["5", "5"]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in (first, streamed, embedded)
            ] == ["4", "3", "2"]
    assert first.headers["x-ratelimit-limit-tokens"] == "1000"
    left = [int(r.headers["x-ratelimit-remaining-tokens"]) for r in (first, streamed)]
    assert 1000 - 12 <= left[0] < 1000 and left[1] < left[0]  # charged prompt + max_tokens
    assert unlimited.status_code == 404  # bob's model is not served; no limits, no headers
    assert "x-ratelimit-limit-requests" not in unlimited.headers


async def test_anthropic_clients_get_anthropics_header_names() -> None:
    async with fleet(FakeConfig(), auth=keys(requests_per_minute=5)) as (proxy, _):
        answer = await post(proxy, {"model": "fake", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}]}, "/v1/messages",
            headers={"x-api-key": "sk-alice"})
    assert answer.status_code == 200
    assert answer.headers["anthropic-ratelimit-requests-limit"] == "5"
    assert answer.headers["anthropic-ratelimit-requests-remaining"] == "4"
    assert "x-ratelimit-limit-requests" not in answer.headers
