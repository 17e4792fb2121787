"""The admin API against in-process fakes: list, add/remove, policy switch, reload."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.fakes.fake_vllm import FakeConfig, serve_fake
from tests.proxy.fakes import ADMIN, ADMIN_TOKEN, CHAT, fleet, post

TOKEN = {"authorization": "Bearer s3cret"}


async def admin(proxy: Any, method: str, path: str, body: Any = None,
                headers: dict[str, str] = TOKEN) -> httpx.Response:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as http:
        return await http.request(method, f"/admin/{path}", json=body, headers=headers)


async def test_list_backends_with_live_stats_needs_the_token() -> None:
    async with fleet(FakeConfig(), FakeConfig(), admin={"token": "s3cret"}) as (proxy, _):
        await post(proxy, CHAT)
        listing = await admin(proxy, "GET", "backends")
        anonymous = await admin(proxy, "GET", "backends", headers={})
    assert anonymous.status_code == 401
    body = listing.json()
    assert body["policy"] == {"name": "round_robin", "params": {}}
    assert body["state"] == {"backend": "memory", "connected": True, "replicas": 1}
    assert [b["name"] for b in body["backends"]] == ["f0", "f1"]
    first = body["backends"][0]
    assert first["healthy"] is True and first["draining"] is False
    assert first["inflight"] == 0 and first["running"] == 0 and first["kv_usage"] == 0.0


async def test_add_and_remove_a_backend_at_runtime() -> None:
    async with fleet(FakeConfig(), admin={"token": "s3cret",
                                          "backend_allowlist": ["127.0.0.0/8"]}) as (
            proxy, _), serve_fake(FakeConfig()) as extra:
        added = await admin(proxy, "POST", "backends",
                            {"name": "new", "url": extra.url, "model": "fake",
                             "labels": {"gpu": "l4"}})
        duplicate = await admin(proxy, "POST", "backends",
                                {"name": "new", "url": extra.url, "model": "fake"})
        bad = await admin(proxy, "POST", "backends", {"name": "x", "url": "nope",
                                                      "model": "fake"})
        served = {(await post(proxy, CHAT)).headers["x-laneway-backend"] for _ in range(4)}
        removed = await admin(proxy, "DELETE", "backends/new")
        after = {(await post(proxy, CHAT)).headers["x-laneway-backend"] for _ in range(4)}
        missing = await admin(proxy, "DELETE", "backends/new")
    assert added.status_code == 201
    assert added.json()["healthy"] is True and added.json()["labels"] == {"gpu": "l4"}
    assert duplicate.status_code == 409 and duplicate.json()["error"]["code"] == "conflict"
    assert bad.status_code == 400 and "url" in bad.json()["error"]["message"]
    assert served == {"f0", "new"}
    assert removed.json() == {"backend": "new", "removed": True, "moving": 0}
    assert after == {"f0"}
    assert missing.status_code == 404


async def test_switch_policy_and_params_at_runtime() -> None:
    async with fleet(FakeConfig(), FakeConfig(), FakeConfig(),
                     admin={"token": "s3cret"}) as (proxy, _):
        before = {(await post(proxy, CHAT, headers={"x-session-id": "s"})
                   ).headers["x-laneway-backend"] for _ in range(3)}
        switched = await admin(proxy, "PUT", "policy",
                               {"name": "session", "params": {"virtual_nodes": 7}})
        after = {(await post(proxy, CHAT, headers={"x-session-id": "s"})
                  ).headers["x-laneway-backend"] for _ in range(6)}
        current = await admin(proxy, "GET", "policy")
        unknown = await admin(proxy, "PUT", "policy", {"name": "nope"})
        bad_params = await admin(proxy, "PUT", "policy",
                                 {"name": "session", "params": {"virtual_nodes": 0}})
        unloadable = await admin(proxy, "PUT", "policy", {
            "name": "qos_drl", "params": {"checkpoint": "/nonexistent/best.pt"}})
        still = await admin(proxy, "GET", "policy")
        metrics = (await httpx.AsyncClient().get(f"{proxy.url}/metrics")).text
    assert len(before) == 3  # round robin ignores the session
    assert switched.status_code == 200
    assert len(after) == 1  # the session sticks now
    assert current.json() == {"name": "session", "params": {"virtual_nodes": 7}}
    assert unknown.status_code == 400 and "unknown policy" in unknown.json()["error"]["message"]
    assert bad_params.status_code == 400 and bad_params.json()["error"]["param"] == "params"
    # a policy that cannot load its files is the client's error, and changes nothing
    assert unloadable.status_code == 400 and unloadable.json()["error"]["param"] == "params"
    assert "/nonexistent/best.pt" in unloadable.json()["error"]["message"]
    assert still.json()["name"] == "session"
    assert 'laneway_routing_decision_seconds_count{policy="session"} 6.0' in metrics


async def test_reload_applies_backends_policy_and_auth(tmp_path: Path) -> None:
    async with fleet(FakeConfig(), FakeConfig()) as (proxy, fakes):
        rt = proxy.app.runtime
        assert rt is not None
        path = tmp_path / "laneway.yaml"
        rt.config_path = str(path)
        config = {"server": {"port": 0}, "policy": {"name": "least_request"},
                  "backends": [{"name": "f1", "url": fakes[1].url, "model": "fake"}],
                  "model_groups": {"team": ["fake"]},
                  "auth": {"enabled": True, "keys": [
                      {"name": "k", "sha256": "a" * 64}]},
                  "upstream": {"max_attempts": 2}, "admin": {"token": ADMIN_TOKEN}}
        path.write_text(yaml.safe_dump(config))
        reloaded = await admin(proxy, "POST", "reload", headers=ADMIN)
        unauthorized = await post(proxy, CHAT)
        path.write_text("server: {prot: 1}")
        rejected = await admin(proxy, "POST", "reload", headers=ADMIN)
        policy = rt.router.policy_name
    assert reloaded.json() == {"added": [], "removed": ["f0"], "replaced": [],
                               "model_groups": ["team"],
                               "policy": "least_request", "auth": True,
                               "needs_restart": ["upstream"]}
    assert unauthorized.status_code == 401
    assert rejected.status_code == 400 and "server.prot" in rejected.json()["error"]["message"]
    assert policy == "least_request"
    assert [b.name for b in rt.registry.all()] == ["f1"]
    assert rt.registry.serves("team")


async def test_a_reload_reads_and_builds_off_the_event_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a config builds its policy, which for qos_drl loads a checkpoint and an
    encoder (~0.4 s): done on the event loop it would stall every stream the proxy
    relays that long. Here reading the file and building its policy take 0.3 s each
    (time.sleep, as blocking work does) and the loop must keep ticking meanwhile."""
    import time

    import proxy.reconfigure as reconfigure
    from policies import base

    def slow(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.3)
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(reconfigure, "load_settings_and_policy",
                        slow(reconfigure.load_settings_and_policy))
    monkeypatch.setattr(base, "build_policy", slow(base.build_policy))  # the config's check
    async with fleet(FakeConfig()) as (proxy, fakes):
        rt = proxy.app.runtime
        assert rt is not None
        path = tmp_path / "laneway.yaml"
        rt.config_path = str(path)
        path.write_text(yaml.safe_dump({
            "server": {"port": 0}, "policy": {"name": "least_request"},
            "backends": [{"name": "f0", "url": fakes[0].url, "model": "fake"}],
            "admin": {"token": ADMIN_TOKEN}}))
        gaps: list[float] = []

        async def tick() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        reloaded = await admin(proxy, "POST", "reload", headers=ADMIN)
        ticker.cancel()
    assert reloaded.status_code == 200 and reloaded.json()["policy"] == "least_request"
    assert sum(gaps) > 0.5  # the ticker ran across both slow steps
    assert max(gaps) < 0.2, max(gaps)  # and the loop never stopped for one of them
