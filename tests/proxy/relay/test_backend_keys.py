"""Backends that want an API key (vLLM's `--api-key`): each gets its own key
(`backends[].api_key`, else `upstream.api_key`) on every request the proxy sends it,
and never a client's laneway key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import yaml

from bench.fakes.fake_vllm import FakeConfig
from proxy.config import Settings
from proxy.runtime import backends_from
from proxy.types import Backend
from tests.proxy.admission.test_auth import keys
from tests.proxy.fakes import ADMIN, CHAT, fleet, post
from tests.proxy.migration.test_migration import expected_text, migrated_comments, stream_text

ASK = {**CHAT, "max_tokens": 3}


async def test_each_backend_gets_its_own_key_in_place_of_the_clients() -> None:
    a, b = FakeConfig(api_key="key-a", aliases=("lora",)), FakeConfig(api_key="key-b")
    async with fleet(a, b, FakeConfig(), keys=("key-a", None),
                     upstream={"api_key": "key-b"}) as (proxy, fakes):
        client = {"authorization": "Bearer the-clients-own"}
        chats = [await post(proxy, ASK, headers=client) for _ in range(3)]
        streamed = await post(proxy, {**ASK, "stream": True}, headers=client)
        adapter = await post(proxy, {**ASK, "model": "lora"})  # listed behind the key
        embedded = await post(proxy, {"model": "fake", "input": "x"}, "/v1/embeddings")
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            described = (await http.get("/admin/backends", headers=ADMIN)).text
    assert [c.status_code for c in chats] == [200] * 3  # f2 has upstream.api_key too
    assert {c.headers["x-laneway-backend"] for c in chats} == {"f0", "f1", "f2"}
    assert streamed.status_code == adapter.status_code == embedded.status_code == 200
    assert adapter.headers["x-laneway-backend"] == "f0"
    assert set(fakes[0].app.stats.credentials) == {"Bearer key-a"}  # /v1/models too
    assert set(fakes[1].app.stats.credentials) == {"Bearer key-b"}
    assert set(fakes[2].app.stats.credentials) == {"Bearer key-b"}
    assert "key-a" not in described and "key-b" not in described
    assert "key-a" not in repr(Backend("f0", "http://x", "m", api_key="key-a"))


async def test_without_keys_the_clients_authorization_passes_unless_laneway_checks_it(
        ) -> None:
    async with fleet(FakeConfig()) as (proxy, fakes):
        passed = await post(proxy, ASK, headers={"authorization": "Bearer vllm-key"})
    async with fleet(FakeConfig(), auth=keys()) as (proxy, checked):
        kept = await post(proxy, ASK, headers={"authorization": "Bearer sk-alice"})
        anthropic = await post(proxy, {"model": "fake", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}]}, "/v1/messages",
            headers={"x-api-key": "sk-alice"})
        seen = checked[0].app.stats.credentials[-2:]
    assert passed.status_code == kept.status_code == anthropic.status_code == 200
    assert fakes[0].app.stats.credentials[-1] == "Bearer vllm-key"
    assert seen == [None, None]  # a laneway key is not the backend's


async def test_a_migrating_stream_continues_with_the_targets_key() -> None:
    async with fleet(FakeConfig(tpot_s=0.02, api_key="key-a"),
                     FakeConfig(tpot_s=0.02, api_key="key-b"), keys=("key-a", "key-b"),
                     debug={"allow_forced_migration": True}) as (proxy, fakes):
        response = await post(proxy, {**CHAT, "stream": True, "max_tokens": 8},
                              headers={"x-laneway-migrate-after": "3",
                                       "x-laneway-events": "1"})
    assert response.status_code == 200
    assert stream_text(response) == expected_text(8)
    (moved,) = migrated_comments(response)
    assert moved["to"] == "f1"
    assert set(fakes[1].app.stats.credentials) == {"Bearer key-b"}


async def test_a_wrong_key_is_the_backends_401_relayed() -> None:
    async with fleet(FakeConfig(api_key="right"), keys=("wrong",)) as (proxy, _):
        refused = await post(proxy, ASK)
    assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}


async def test_a_reload_with_a_new_key_replaces_the_backend(tmp_path: Path) -> None:
    async with fleet(FakeConfig(api_key="old"), keys=("old",)) as (proxy, fakes):
        rt = proxy.app.runtime
        assert rt is not None
        path = tmp_path / "laneway.yaml"
        rt.config_path = str(path)
        before = await post(proxy, ASK)
        fakes[0].app.config = dataclasses.replace(fakes[0].app.config, api_key="new")
        path.write_text(yaml.safe_dump({"server": {"port": 0}, "backends": [
            {"name": "f0", "url": fakes[0].url, "model": "fake", "api_key": "new"}]}))
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            reloaded = (await http.post("/admin/reload", headers=ADMIN)).json()
        after = await post(proxy, ASK)
    assert before.status_code == after.status_code == 200
    assert reloaded["replaced"] == ["f0"]
    assert fakes[0].app.stats.credentials[-1] == "Bearer new"


def test_an_empty_key_is_no_key() -> None:  # `LANEWAY_UPSTREAM__API_KEY=` in compose
    settings = Settings(backends=[{"name": "a", "url": "http://a:1", "model": "m"},  # type: ignore[list-item]
                                  {"name": "b", "url": "http://b:1", "model": "m",
                                   "api_key": "own"}],
                        upstream={"api_key": ""})  # type: ignore[arg-type]
    assert [b.api_key for b in backends_from(settings)] == [None, "own"]
