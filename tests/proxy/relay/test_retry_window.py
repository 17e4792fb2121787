"""`upstream.retry_window_s`: a request none of whose backends answered waits and tries
them again until the window since its arrival is spent, instead of failing at once."""

from __future__ import annotations

import asyncio
import time

import httpx

from bench.fakes.fake_vllm import FakeConfig
from tests.proxy.fakes import ADMIN, ADMIN_TOKEN, CHAT, fleet, post
from tests.proxy.migration.test_migration import expected_text, stream_text

ONE_TRY = {"max_attempts": 1}


async def _metrics(url: str) -> str:
    async with httpx.AsyncClient(base_url=url) as http:
        return (await http.get("/metrics")).text


async def test_a_failing_backend_is_tried_again_until_it_answers() -> None:
    async with fleet(FakeConfig(fail_status=503, fail_first=3),
                     upstream={**ONE_TRY, "retry_window_s": 10}) as (proxy, fakes):
        started = time.monotonic()
        answer = await post(proxy, {**CHAT, "stream": True, "max_tokens": 5})
        waited = time.monotonic() - started
        metrics = await _metrics(proxy.url)
    assert answer.status_code == 200 and stream_text(answer) == expected_text(5)
    assert fakes[0].app.stats.requests == 4
    assert 0.7 <= waited < 5  # 0.1 + 0.2 + 0.4 s of backoff
    assert 'laneway_retry_waits_total{model="fake"} 3.0' in metrics


async def test_without_a_window_the_failure_is_answered_at_once() -> None:
    async with fleet(FakeConfig(fail_status=503, fail_first=3),
                     upstream=ONE_TRY) as (proxy, fakes):
        answer = await post(proxy, CHAT)
    assert answer.status_code == 502 and fakes[0].app.stats.requests == 1


async def test_a_request_outlasting_its_window_gets_the_error() -> None:
    async with fleet(FakeConfig(fail_status=503), upstream={**ONE_TRY, "retry_window_s": 0.5}
                     ) as (proxy, fakes):
        started = time.monotonic()
        answer = await post(proxy, CHAT)
        waited = time.monotonic() - started
    assert answer.status_code == 502
    assert answer.json()["error"]["code"] == "upstream_failed"
    assert 0.5 <= waited < 2 and fakes[0].app.stats.requests >= 3


async def test_a_request_waits_while_the_only_backend_is_drained() -> None:
    async with fleet(FakeConfig(), upstream={"retry_window_s": 10},
                     admin={"token": ADMIN_TOKEN}) as (proxy, fakes):
        async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as http:
            assert (await http.post("/admin/backends/f0/drain", headers=ADMIN)).status_code == 200
            waiting = asyncio.create_task(post(proxy, CHAT))
            await asyncio.sleep(0.5)
            assert not waiting.done() and fakes[0].app.stats.requests == 0
            assert (await http.post("/admin/backends/f0/undrain", headers=ADMIN)).status_code == 200
            answer = await waiting
    assert answer.status_code == 200 and answer.headers["x-laneway-backend"] == "f0"


async def test_pass_through_requests_wait_too() -> None:
    async with fleet(FakeConfig(fail_status=503, fail_first=2),
                     upstream={**ONE_TRY, "retry_window_s": 10}) as (proxy, fakes):
        embedded = await post(proxy, {"model": "fake", "input": "x"}, "/v1/embeddings")
    assert embedded.status_code == 200 and fakes[0].app.stats.requests == 3


async def test_each_round_tries_the_fallbacks_again() -> None:
    async with fleet(FakeConfig(model="big", fail_status=503),
                     FakeConfig(model="small", fail_status=503, fail_first=1),
                     model_fallbacks={"big": ["small"]},
                     upstream={**ONE_TRY, "retry_window_s": 10}) as (proxy, fakes):
        answer = await post(proxy, {**CHAT, "model": "big"})
    assert answer.status_code == 200 and answer.json()["model"] == "small"
    assert [f.app.stats.requests for f in fakes] == [2, 2]


async def test_a_client_leaving_while_it_waits_ends_the_request() -> None:
    async with fleet(FakeConfig(), upstream={"retry_window_s": 10},
                     admin={"token": ADMIN_TOKEN}) as (proxy, fakes):
        async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as http:
            assert (await http.post("/admin/backends/f0/drain", headers=ADMIN)).status_code == 200
            try:
                await post(proxy, CHAT, timeout=0.5)
            except httpx.ReadTimeout:
                pass  # the client gave up and closed its connection
            await asyncio.sleep(0.2)
            assert (await http.post("/admin/backends/f0/undrain", headers=ADMIN)).status_code == 200
            await asyncio.sleep(1.5)  # longer than a pause: a live wait would have sent it
            metrics = await _metrics(proxy.url)
    assert fakes[0].app.stats.requests == 0
    assert 'laneway_client_disconnects_total{backend="-",model="fake"} 1.0' in metrics
