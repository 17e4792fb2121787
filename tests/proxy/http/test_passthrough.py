"""Embeddings, tokenize and the other endpoints that generate nothing, through the proxy."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from bench.fakes.fake_vllm import FakeConfig
from tests.proxy.admission.test_auth import bearer, keys
from tests.proxy.fakes import fleet, post

EMBED = {"model": "fake", "input": ["the first text", "another one"], "dimensions": 8}


async def test_embeddings_are_relayed_untouched_to_the_least_loaded_backend() -> None:
    async with fleet(FakeConfig(), FakeConfig()) as (proxy, fakes):
        async with httpx.AsyncClient() as http:
            direct = (await http.post(f"{fakes[0].url}/v1/embeddings", json=EMBED)).content
        fakes[0].app.stats.bodies.clear()
        answers = [await post(proxy, EMBED, "/v1/embeddings", headers={"x-request-id": "e1"})
                   for _ in range(4)]
        metrics = (await httpx.AsyncClient().get(f"{proxy.url}/metrics")).text
    assert [a.status_code for a in answers] == [200] * 4
    assert {a.content for a in answers} == {direct}  # the backend's bytes
    assert answers[0].headers["x-request-id"] == "e1"
    # Ties on open requests take turns: sequential requests alternate.
    order = [a.headers["x-laneway-backend"] for a in answers]
    assert order in (["f0", "f1"] * 2, ["f1", "f0"] * 2)
    assert fakes[0].app.stats.bodies == [EMBED, EMBED]  # every field, unchanged
    assert 'laneway_passthrough_requests_total{backend="f0",endpoint="/v1/embeddings",' \
        'model="fake",status="200"} 2.0' in metrics
    assert 'laneway_passthrough_seconds_count{endpoint="/v1/embeddings",model="fake"} 4.0' \
        in metrics
    assert proxy.app.runtime.registry.inflight == {"f0": 0, "f1": 0}  # type: ignore[union-attr]


async def test_tokenize_reaches_a_generation_backend() -> None:
    async with fleet(FakeConfig()) as (proxy, fakes):
        answer = await post(proxy, {"model": "fake", "prompt": "tok1 tok2"}, "/tokenize")
    assert answer.status_code == 200
    assert answer.json()["count"] == 3  # BOS + two tokens, as the backend counted them
    assert fakes[0].app.stats.tokenized == [{"model": "fake", "prompt": "tok1 tok2"}]


@pytest.mark.parametrize(
    ("method", "body", "status", "code", "param"),
    [
        ("POST", b"{bad", 400, None, None),
        ("POST", b'{"input": "x"}', 400, None, "model"),
        ("POST", b'{"model": "", "input": "x"}', 400, None, "model"),
        ("POST", b'{"model": "nope", "input": "x"}', 404, "model_not_found", "model"),
        ("GET", b"", 405, "method_not_allowed", None),
    ],
)
async def test_bad_requests_get_openai_errors_and_reach_no_backend(
    method: str, body: bytes, status: int, code: str | None, param: str | None
) -> None:
    # (two models: a request naming none has no default, tests/proxy/test_default_model.py)
    async with fleet(FakeConfig(), FakeConfig(model="other")) as (proxy, fakes):
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            answer = await http.request(method, "/v1/embeddings", content=body)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (code, param)
    assert [f.app.stats.requests for f in fakes] == [0, 0]


async def test_a_5xx_fails_over_and_a_4xx_is_relayed() -> None:
    async with fleet(FakeConfig(fail_status=503), FakeConfig()) as (proxy, fakes):
        moved = [await post(proxy, EMBED, "/v1/embeddings") for _ in range(4)]
    assert [(m.status_code, m.headers["x-laneway-backend"]) for m in moved] == [(200, "f1")] * 4
    assert fakes[0].app.stats.requests >= 1  # tried first at least on one tie
    async with fleet(FakeConfig(fail_status=400), FakeConfig()) as (proxy, fakes):
        answers = [await post(proxy, EMBED, "/v1/embeddings") for _ in range(4)]
    refused = [a for a in answers if a.headers["x-laneway-backend"] == "f0"]
    assert refused and all(a.status_code == 400 for a in refused)  # the backend's verdict
    assert refused[0].json() == {"error": {"message": "injected failure"}}
    assert fakes[1].app.stats.requests == 4 - len(refused)  # not retried elsewhere


async def test_hanging_backends_time_out_with_504() -> None:
    async with fleet(FakeConfig(hang=True), FakeConfig(hang=True),
                     upstream={"first_byte_timeout_s": 0.2}) as (proxy, fakes):
        started = time.monotonic()
        answer = await post(proxy, EMBED, "/v1/embeddings")
    assert answer.status_code == 504
    assert answer.json()["error"]["code"] == "upstream_timeout"
    assert time.monotonic() - started < 2
    assert [f.app.stats.requests for f in fakes] == [1, 1]  # each tried once


async def test_a_client_that_leaves_cancels_the_backends_work() -> None:
    async with fleet(FakeConfig(hang=True)) as (proxy, fakes):
        stats = fakes[0].app.stats
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            call = asyncio.create_task(http.post("/v1/embeddings", json=EMBED))
            for _ in range(500):
                if stats.requests:
                    break
                await asyncio.sleep(0.01)
            call.cancel()
        for _ in range(100):
            if stats.cancelled:
                break
            await asyncio.sleep(0.02)
        rt = proxy.app.runtime
        assert rt is not None
        assert stats.cancelled == 1
        assert rt.registry.inflight["f0"] == 0
        metrics = rt.metrics.render().decode()
        assert 'laneway_passthrough_requests_total{backend="f0",endpoint="/v1/embeddings",' \
            'model="fake",status="499"} 1.0' in metrics
        assert 'laneway_client_disconnects_total{backend="f0",model="fake"} 1.0' in metrics


async def test_keys_limit_models_and_are_charged_the_backends_usage() -> None:
    async with fleet(FakeConfig(), FakeConfig(model="other"),
                     auth=keys(tokens_per_minute=10_000)) as (proxy, _):
        rt = proxy.app.runtime
        assert rt is not None
        anonymous = await post(proxy, EMBED, "/v1/embeddings")
        denied = await post(proxy, EMBED, "/v1/embeddings", headers=bearer("sk-bob"))
        answer = await post(proxy, EMBED, "/v1/embeddings", headers=bearer("sk-alice"))
        used = rt.auth.limiter.used("alice:tokens", time.time())
    assert (anonymous.status_code, denied.status_code, answer.status_code) == (401, 403, 200)
    assert used == pytest.approx(answer.json()["usage"]["prompt_tokens"], abs=1e-3)


async def test_a_model_group_sends_its_members_name() -> None:
    async with fleet(FakeConfig(model="a"), FakeConfig(model="b"),
                     model_groups={"team": ["a", "b"]}) as (proxy, fakes):
        answers = [await post(proxy, {**EMBED, "model": "team"}, "/v1/embeddings")
                   for _ in range(2)]
    assert sorted(a.json()["model"] for a in answers) == ["a", "b"]
    assert [f.app.stats.last_body["model"] for f in fakes] == ["a", "b"]  # type: ignore[index]
