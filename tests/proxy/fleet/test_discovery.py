"""LoRA adapters and other served names, read from each backend's `/v1/models`
(proxy/fleet/discovery.py): routed to the backends that serve them, under their own name."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx

from bench.fakes.fake_vllm import FakeConfig, serve_fake
from proxy.fleet.discovery import context_length, model_ids, model_list
from tests.proxy.fakes import ADMIN, CHAT, fleet, post
from tests.proxy.migration.test_migration import (
    continuation_bodies,
    expected_text,
    migrated_comments,
    stream_text,
)

SQL = {**CHAT, "model": "sql-lora", "max_tokens": 4}


async def test_an_adapter_goes_to_the_backends_that_list_it_under_its_name() -> None:
    with_lora = FakeConfig(aliases=("sql-lora",))
    async with fleet(FakeConfig(), with_lora, FakeConfig(), with_lora) as (proxy, fakes):
        answers = [await post(proxy, SQL) for _ in range(4)]
        base = [await post(proxy, {**CHAT, "max_tokens": 2}) for _ in range(4)]
        missing = await post(proxy, {**SQL, "model": "other-lora"})
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            listed = (await http.get("/v1/models")).json()
            described = (await http.get("/admin/backends", headers=ADMIN)).json()["backends"]
    assert [a.status_code for a in answers] == [200] * 4
    assert {a.headers["x-laneway-backend"] for a in answers} == {"f1", "f3"}
    assert all(a.json()["model"] == "sql-lora" for a in answers)
    assert [b["model"] for f in (fakes[1], fakes[3]) for b in f.app.stats.bodies
            if b["max_tokens"] == 4] == ["sql-lora"] * 4  # named as is upstream
    assert {b.headers["x-laneway-backend"] for b in base} == {"f0", "f1", "f2", "f3"}
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert [m["id"] for m in listed["data"]] == ["fake", "sql-lora"]
    assert [b["serves"] for b in described] == [["fake"], ["fake", "sql-lora"]] * 2


async def test_adapters_loaded_and_unloaded_at_run_time_follow_the_next_read() -> None:
    async with fleet(FakeConfig(), FakeConfig()) as (proxy, fakes):
        before = await post(proxy, SQL)
        fakes[0].app.config = dataclasses.replace(fakes[0].app.config, aliases=("sql-lora",))
        assert proxy.app.runtime is not None
        discovery = proxy.app.runtime.discovery
        assert await discovery.once() == 1
        loaded = [await post(proxy, SQL) for _ in range(2)]
        fakes[0].app.config = dataclasses.replace(fakes[0].app.config, aliases=())
        assert await discovery.once() == 1
        after = await post(proxy, SQL)
    assert before.status_code == after.status_code == 404
    assert [r.headers["x-laneway-backend"] for r in loaded] == ["f0", "f0"]


async def test_discovery_off_serves_only_configured_models() -> None:
    async with fleet(FakeConfig(aliases=("sql-lora",)),
                     poller={"models_interval_s": 0}) as (proxy, _):
        answer = await post(proxy, SQL)
    assert answer.status_code == 404


async def test_a_stream_for_an_adapter_migrates_to_a_backend_with_it_and_keeps_its_name(
        ) -> None:
    lora = FakeConfig(aliases=("sql-lora",), tpot_s=0.02)
    async with fleet(lora, FakeConfig(tpot_s=0.02), lora,
                     debug={"allow_forced_migration": True}) as (proxy, fakes):
        response = await post(proxy, {**SQL, "stream": True, "max_tokens": 8},
                              headers={"x-laneway-migrate-after": "3",
                                       "x-laneway-events": "1"})
    assert response.status_code == 200
    (moved,) = migrated_comments(response)
    assert (response.headers["x-laneway-backend"], moved["to"]) == ("f0", "f2")  # not f1
    (continuation,) = continuation_bodies(fakes[2])
    assert continuation["model"] == "sql-lora"
    assert stream_text(response) == expected_text(8)  # nothing lost or repeated


async def test_the_model_list_gives_the_context_every_backend_of_a_model_has() -> None:
    """As vLLM's /v1/models: clients size prompts by `max_model_len`; a request may go
    to any backend of its model, so the smallest known one is listed."""
    async with fleet(FakeConfig(max_model_len=4096), FakeConfig(max_model_len=2048)) as (
            proxy, _):
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            listed = (await http.get("/v1/models")).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in listed] == [("fake", 2048)]


def test_a_model_list_is_read_leniently() -> None:
    listed = model_list(b'{"data": [{"id": "a"}, {"id": 3}, "b", {"id": "c", '
                        b'"max_model_len": 1024}]}')
    assert listed is not None
    assert model_ids(listed) == ["a", "c"] and context_length(listed) == 1024
    assert context_length([{"id": "a", "max_model_len": "1024"}, {"max_model_len": 0}]) is None
    assert model_list(b"[]") is None and model_list(b"not json") is None
    assert model_list(b'{"data": {}}') is None


async def test_another_replicas_notice_reads_the_backends_it_names() -> None:
    """The `discovery` shared table: this replica's announcements go out once; one merged
    from another replica reads the named backends' lists now (unknown names skipped)."""
    async with fleet(FakeConfig(), FakeConfig(), poller={"models_interval_s": 3600}) as (
            proxy, fakes):
        assert proxy.app.runtime is not None
        discovery = proxy.app.runtime.discovery
        discovery.announce(["f1", "f0"])
        discovery.announce(["f1"])
        assert discovery.export_updates() == [["f0", "f1"]]
        assert discovery.export_updates() == []  # each goes out once
        for fake in fakes:  # loaded behind this replica's back (by another replica)
            fake.app.config = dataclasses.replace(fake.app.config, aliases=("sql-lora",))
        discovery.merge_updates([["f1", "nope"], "f0", [3]])
        for _ in range(50):
            await asyncio.sleep(0.01)
            served = proxy.app.runtime.registry.served_by("f1")
            if "sql-lora" in served:
                break
        answers = [await post(proxy, SQL) for _ in range(2)]
        assert discovery.export_updates() == []  # merged notices are not sent back
    assert [a.headers["x-laneway-backend"] for a in answers] == ["f1", "f1"]  # f0 not read


async def test_a_backend_that_does_not_list_its_configured_model_gets_none_of_its_requests(
) -> None:
    """A server restarted with another model (or a wrong --served-model-name): vLLM would
    answer each request for the configured model with a 404, which the proxy would
    relay as the backend's own error."""
    async with serve_fake(FakeConfig(model="other")) as wrong, \
            fleet(FakeConfig(), extra_backends=[{"name": "wrong", "url": wrong.url,
                                                 "model": "fake"}]) as (proxy, _):
        answers = [await post(proxy, {**CHAT, "max_tokens": 2}) for _ in range(6)]
        other = await post(proxy, {**CHAT, "model": "other", "max_tokens": 2})
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            described = (await http.get("/admin/backends", headers=ADMIN)).json()["backends"]
        assert [a.status_code for a in answers] == [200] * 6
        assert {a.headers["x-laneway-backend"] for a in answers} == {"f0"}
        assert wrong.app.stats.requests == 1  # the one for the model it does serve
        assert other.status_code == 200 and other.headers["x-laneway-backend"] == "wrong"
        assert [b["serves"] for b in described] == [["fake"], ["other"]]
        wrong.app.config = dataclasses.replace(wrong.app.config, aliases=("fake",))
        await proxy.app.runtime.discovery.once()  # (its next read)
        served = {(await post(proxy, {**CHAT, "max_tokens": 2})).headers["x-laneway-backend"]
                  for _ in range(4)}
        assert served == {"f0", "wrong"}


async def test_with_require_listed_model_off_such_a_backend_is_routed_to() -> None:
    async with serve_fake(FakeConfig(model="other")) as wrong, \
            fleet(FakeConfig(), poller={"require_listed_model": False},
                  extra_backends=[{"name": "wrong", "url": wrong.url, "model": "fake"}]
                  ) as (proxy, _):
        statuses = {(await post(proxy, {**CHAT, "max_tokens": 2})).status_code
                    for _ in range(6)}
    assert statuses == {200, 404}  # the fake's own 404 for a model it does not serve
