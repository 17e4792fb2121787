"""`/admin/lora_adapters` (proxy/http/lora_admin.py): load and unload a LoRA adapter on many
backends with one call; routable (or not) from the next request on."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from bench.fakes.fake_vllm import FakeConfig
from bench.harness.ports import free_port
from tests.proxy.fakes import ADMIN, CHAT, fleet, post

LORA = FakeConfig(lora_runtime=True)
OTHER = FakeConfig(model="other", lora_runtime=True)
NO_READS = {"models_interval_s": 3600}  # only the admin routes' own reads
SQL = {**CHAT, "model": "sql", "max_tokens": 2}


async def _admin(proxy: Any, method: str, path: str, body: Any = None,
                 headers: dict[str, str] = ADMIN) -> httpx.Response:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as http:
        return await http.request(method, "/admin/lora_adapters" + path, json=body,
                                  headers=headers)


async def test_loading_on_a_base_model_makes_the_adapter_routable_at_once() -> None:
    async with fleet(LORA, LORA, OTHER, poller=NO_READS) as (proxy, fakes):
        before = await post(proxy, SQL)
        loaded = await _admin(proxy, "POST", "", {"lora_name": "sql", "lora_path": "/a/sql",
                                                  "model": "fake"})
        routed = [await post(proxy, SQL) for _ in range(4)]
        again = await _admin(proxy, "POST", "", {"lora_name": "sql", "lora_path": "/a/sql",
                                                 "model": "fake"})
        listed = (await _admin(proxy, "GET", "")).json()
    assert before.status_code == 404
    assert loaded.status_code == 200, loaded.text
    assert [(r["backend"], r["result"]) for r in loaded.json()["backends"]] == [
        ("f0", "loaded"), ("f1", "loaded")]  # not f2: another base model
    assert [f.app.adapters for f in fakes] == [{"sql": "/a/sql"}, {"sql": "/a/sql"}, {}]
    assert {r.headers["x-laneway-backend"] for r in routed} == {"f0", "f1"}
    assert {r.json()["model"] for r in routed} == {"sql"}
    assert again.status_code == 200  # a retry is safe
    assert {r["result"] for r in again.json()["backends"]} == {"already_loaded"}
    assert listed == {"data": [{"lora_name": "sql", "backends": ["f0", "f1"]}]}


async def test_a_backend_that_cannot_load_it_is_reported_and_not_routed_to() -> None:
    async with fleet(LORA, FakeConfig(), poller=NO_READS,
                     extra_backends=[{"name": "gone", "url": f"http://127.0.0.1:{free_port()}",
                                      "model": "fake"}]) as (proxy, _):
        answer = await _admin(proxy, "POST", "", {"lora_name": "sql", "lora_path": "/a/sql",
                                                  "model": "fake", "timeout_s": 5})
        routed = [await post(proxy, SQL) for _ in range(3)]
    assert answer.status_code == 502
    report = answer.json()
    assert report["error"]["code"] == "lora_failed" and "f1, gone" in report["error"]["message"]
    results = {r["backend"]: r for r in report["backends"]}
    assert results["f0"]["result"] == "loaded"
    assert results["f1"]["result"] == "failed" and results["f1"]["status"] == 404
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in results["f1"]["detail"]
    assert results["gone"]["result"] == "failed" and results["gone"]["detail"].startswith(
        "connect")
    assert {r.headers["x-laneway-backend"] for r in routed} == {"f0"}


async def test_unloading_stops_routing_and_a_second_unload_is_a_404() -> None:
    async with fleet(LORA, LORA, poller=NO_READS) as (proxy, fakes):
        await _admin(proxy, "POST", "", {"lora_name": "sql", "lora_path": "/a/sql",
                                         "backends": ["f0", "f1"]})
        served = await post(proxy, SQL)
        fakes[1].app.adapters.clear()  # unloaded there behind the proxy's back
        unloaded = await _admin(proxy, "DELETE", "/sql")
        after = await post(proxy, SQL)
        again = await _admin(proxy, "DELETE", "/sql")
        listed = (await _admin(proxy, "GET", "")).json()
    assert served.status_code == 200
    assert unloaded.status_code == 200, unloaded.text
    assert [(r["backend"], r["result"]) for r in unloaded.json()["backends"]] == [
        ("f0", "unloaded"), ("f1", "not_loaded")]
    assert [f.app.adapters for f in fakes] == [{}, {}]
    assert after.status_code == 404 and after.json()["error"]["code"] == "model_not_found"
    assert again.status_code == 404 and again.json()["error"]["code"] == "not_found"
    assert listed == {"data": []}


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"lora_name": "sql", "lora_path": "/a"}, 400, "either `model`"),
    ({"lora_name": "sql", "lora_path": "/a", "model": "fake", "backends": ["f0"]}, 400,
     "either `model`"),
    ({"lora_name": "sql", "lora_path": "/a", "model": "nope"}, 404, "base model `nope`"),
    ({"lora_name": "sql", "lora_path": "/a", "backends": ["f0", "x"]}, 404, "`x`"),
    ({"lora_name": "fake", "lora_path": "/a", "model": "fake"}, 400, "base model"),
    ({"lora_name": "sql", "lora_path": "/a", "model": "fake", "timeout_s": 0}, 400,
     "timeout_s"),
    ({"lora_name": "", "lora_path": "/a", "model": "fake"}, 400, "lora_name"),
    ({"lora_name": "sql", "lora_path": "/a", "model": "fake", "extra": 1}, 400, "extra"),
    ([1, 2], 400, "body"),
])
async def test_a_bad_load_request_is_a_clear_error(body: Any, status: int,
                                                   words: str) -> None:
    async with fleet(LORA) as (proxy, fakes):
        answer = await _admin(proxy, "POST", "", body)
    assert answer.status_code == status
    assert words in answer.json()["error"]["message"]
    assert fakes[0].app.adapters == {}


async def test_the_admin_token_guards_the_lora_routes() -> None:
    async with fleet(LORA, admin={"token": "t0p"}) as (proxy, fakes):
        refused = await _admin(proxy, "POST", "", {"lora_name": "sql", "lora_path": "/a",
                                                   "model": "fake"})
    assert refused.status_code == 401 and fakes[0].app.adapters == {}
