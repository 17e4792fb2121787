"""Model fallbacks (`model_fallbacks`): a request none of whose model's backends
answered before the first byte goes to the next model of its list."""

from __future__ import annotations

import logging

import httpx
import pytest

from bench.fakes.fake_vllm import FakeConfig
from proxy.config import ConfigError, Settings
from tests.proxy.fakes import CHAT, fleet, post
from tests.proxy.migration.test_migration import expected_text, stream_text

BIG = {**CHAT, "model": "big", "max_tokens": 3}
DOWN = {"name": "gone", "url": "http://127.0.0.1:9", "model": "gone"}  # refuses


async def test_a_failing_model_falls_back_in_order(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "laneway.access")
    failing = FakeConfig(model="big", fail_status=503)
    async with fleet(failing, failing, FakeConfig(model="mid", fail_status=500),
                     FakeConfig(model="small"),
                     model_fallbacks={"big": ["mid", "small"]},
                     server={"access_log": True}) as (proxy, fakes):
        whole = await post(proxy, BIG)
        streamed = await post(proxy, {**BIG, "stream": True, "max_tokens": 6})
        small = await post(proxy, {**BIG, "model": "small"})
        mid = await post(proxy, {**BIG, "model": "mid"})  # no fallbacks of its own
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            metrics = (await http.get("/metrics")).text
    assert whole.status_code == 200 and whole.json()["model"] == "small"
    assert whole.headers["x-laneway-backend"] == "f3"
    assert [f.app.stats.requests for f in fakes] == [2, 2, 3, 3]  # each once a request
    assert fakes[3].app.stats.bodies[0]["model"] == "small"
    assert streamed.status_code == 200 and stream_text(streamed) == expected_text(6)
    assert small.status_code == 200 and mid.status_code == 502
    assert 'laneway_fallbacks_total{fallback="small",model="big"} 2.0' in metrics
    assert 'laneway_fallbacks_total{fallback="mid",model="big"} 2.0' in metrics
    access = [r.fields for r in caplog.records if r.name == "laneway.access"]  # type: ignore[attr-defined]
    assert [(a.get("fallback_from"), a.get("model")) for a in access][:2] == [
        ("big", "small"), ("big", "small")]


async def test_a_model_without_a_healthy_backend_falls_back() -> None:
    async with fleet(FakeConfig(model="small"), extra_backends=[DOWN],
                     model_fallbacks={"gone": ["small"]}) as (proxy, _):
        answer = await post(proxy, {**BIG, "model": "gone"})
    assert answer.status_code == 200 and answer.json()["model"] == "small"


async def test_an_answer_is_never_replaced_by_a_fallbacks() -> None:
    # The backend answered (a 4xx of its own): relayed, not retried elsewhere.
    async with fleet(FakeConfig(model="big", fail_status=400), FakeConfig(model="small"),
                     model_fallbacks={"big": ["small"]}) as (proxy, fakes):
        refused = await post(proxy, BIG)
    assert refused.status_code == 400 and fakes[1].app.stats.requests == 0


async def test_without_fallbacks_every_failure_is_the_clients_error() -> None:
    async with fleet(FakeConfig(model="big", fail_status=503), FakeConfig(model="small"),
                     ) as (proxy, fakes):
        failed = await post(proxy, BIG)
    assert failed.status_code == 502 and fakes[1].app.stats.requests == 0


@pytest.mark.parametrize("fallbacks", [{"a": []}, {"a": ["a"]}, {"a": ["b", "b"]}])
def test_fallback_lists_name_other_models_once(fallbacks: dict[str, list[str]]) -> None:
    with pytest.raises((ConfigError, ValueError), match="model_fallbacks"):
        Settings(model_fallbacks=fallbacks)


async def test_pass_through_routes_fall_back_too() -> None:
    async with fleet(FakeConfig(model="big", fail_status=503), FakeConfig(model="small"),
                     model_fallbacks={"big": ["small"]}) as (proxy, fakes):
        embedded = await post(proxy, {"model": "big", "input": "x"}, "/v1/embeddings")
    assert embedded.status_code == 200 and embedded.headers["x-laneway-backend"] == "f1"
    assert embedded.json()["model"] == "small"
    assert fakes[1].app.stats.bodies[-1]["model"] == "small"
