"""#71 part A, findings 1, 3, 11 and 16: the admin API is closed unless a token is set,
keeps only the token's hash, refuses what a browser page or a rebound DNS name could
send, and reloads its settings. Against a real `laneway serve`."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.fakes.fake_vllm import FakeConfig
from bench.harness.proxy_process import ProxyProcess, running_proxy
from proxy.config import load_settings
from proxy.hashing import hash_key
from tests.security.admin_helpers import (
    ADMIN,
    TOKEN,
    admin,
    backends,
    fakes_in_thread,
    raw_status,
)


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[dict[str, Any]]]:
    with fakes_in_thread(FakeConfig()) as fakes:
        yield backends(fakes)


@pytest.fixture(scope="module")
def guarded(fleet: list[dict[str, Any]]) -> Iterator[ProxyProcess]:
    """A proxy whose admin API has a token."""
    with running_proxy({"backends": fleet, "admin": {"token": TOKEN}}) as proxy:
        yield proxy


def test_without_an_admin_section_the_admin_api_is_not_served(
        fleet: list[dict[str, Any]]) -> None:
    with running_proxy({"backends": fleet}) as proxy:
        listing = admin(proxy.url, "GET", "backends", headers={})
        drain = admin(proxy.url, "POST", "backends/f0/drain", headers={})
        served = httpx.post(f"{proxy.url}/v1/chat/completions", timeout=10, json={
            "model": "fake", "messages": [{"role": "user", "content": "hi"}]})
    assert listing.status_code == 404 and drain.status_code == 404
    assert served.status_code == 200  # f0 was not drained


@pytest.mark.parametrize("token", ["", "   "])
def test_an_empty_token_opens_nothing(fleet: list[dict[str, Any]], token: str) -> None:
    """An unset env var (`LANEWAY_ADMIN__TOKEN=`) is no token: admin stays closed, and
    an empty bearer is not a match for it."""
    with running_proxy({"backends": fleet, "admin": {"token": token}}) as proxy:
        empty = raw_status(proxy.url, b"GET /admin/backends HTTP/1.1\r\nHost: localhost\r\n"
                           b"Authorization: Bearer " + token.encode() + b"\r\n"
                           b"Connection: close\r\n\r\n")
        none = admin(proxy.url, "GET", "backends", headers={})
    assert empty == 404 and none.status_code == 404


@pytest.mark.parametrize("section", [{"enabled": True}, {"enabled": True, "token": ""},
                                     {"enabled": True, "token": None}])
def test_a_server_whose_admin_api_would_be_open_does_not_start(
        fleet: list[dict[str, Any]], section: dict[str, Any]) -> None:
    with pytest.raises(RuntimeError, match="proxy exited") as failed, \
            running_proxy({"backends": fleet, "admin": section}, ready_timeout_s=20):
        pass
    assert "admin.token" in str(failed.value)


def test_the_token_is_checked_and_only_its_hash_is_kept(guarded: ProxyProcess) -> None:
    good = admin(guarded.url, "GET", "backends")
    wrong = admin(guarded.url, "GET", "backends", headers={"authorization": "Bearer nope"})
    missing = admin(guarded.url, "GET", "backends", headers={})
    assert good.status_code == 200
    assert wrong.status_code == 401 and missing.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    # in memory: the settings the proxy loads hold the SHA-256, never the token
    settings = load_settings(Path(guarded.config_path))
    assert settings.admin.token_sha256 == hash_key(TOKEN)
    assert TOKEN not in repr(settings) and TOKEN not in settings.model_dump_json()


def test_a_host_name_it_is_not_known_by_is_refused(guarded: ProxyProcess) -> None:
    """DNS rebinding: a page on evil.example whose name now points at the proxy."""
    rebound = admin(guarded.url, "GET", "backends", headers={**ADMIN, "host": "evil.example"})
    loopback = admin(guarded.url, "GET", "backends", headers={**ADMIN, "host": "localhost:1"})
    assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "forbidden"
    assert loopback.status_code == 200


def test_a_cross_origin_request_is_refused(guarded: ProxyProcess) -> None:
    port = guarded.url.rsplit(":", 1)[1]
    cross = admin(guarded.url, "POST", "backends/f0/undrain",
                  headers={**ADMIN, "origin": "https://evil.example"})
    null = admin(guarded.url, "POST", "backends/f0/undrain",
                 headers={**ADMIN, "origin": "null"})
    same = admin(guarded.url, "POST", "backends/f0/undrain",
                 headers={**ADMIN, "origin": f"http://127.0.0.1:{port}"})
    assert cross.status_code == 403 and null.status_code == 403
    assert same.status_code == 200


def test_a_body_must_be_json_by_its_content_type(guarded: ProxyProcess) -> None:
    """A browser's "simple" POST (text/plain, form) cannot carry JSON to /admin."""
    plain = admin(guarded.url, "POST", "backends/f0/undrain", content=b'{"migrate": false}',
                  headers={**ADMIN, "content-type": "text/plain"})
    form = admin(guarded.url, "POST", "backends/f0/undrain", content=b'{"migrate": false}',
                 headers={**ADMIN, "content-type": "application/x-www-form-urlencoded"})
    as_json = admin(guarded.url, "POST", "backends/f0/undrain", json={"migrate": False})
    no_body = admin(guarded.url, "POST", "backends/f0/undrain")
    assert plain.status_code == 415 and form.status_code == 415
    assert plain.json()["error"]["code"] == "unsupported_media_type"
    assert as_json.status_code == 200 and no_body.status_code == 200


def test_online_save_cannot_write_outside_the_configured_directory(
        guarded: ProxyProcess, tmp_path: Path) -> None:
    target = tmp_path / "written.pt"
    answer = admin(guarded.url, "PUT", "policy", json={"name": "qos_drl", "params": {
        "checkpoint": "/nonexistent/best.pt", "learn_online": True,
        "online_save": str(target)}})
    assert answer.status_code == 403 and answer.json()["error"]["param"] == "params"
    assert not target.exists()


def _reload(proxy: ProxyProcess, config: dict[str, Any]) -> None:
    with open(proxy.config_path) as f:
        written = yaml.safe_load(f)
    Path(proxy.config_path).write_text(yaml.safe_dump({**written, **config}))
    os.kill(proxy.pid, signal.SIGHUP)


def _status_until(url: str, expected: int, headers: dict[str, str]) -> int:
    status = 0
    for _ in range(100):  # a SIGHUP reload is applied on the proxy's loop, soon
        status = admin(url, "GET", "backends", headers=headers).status_code
        if status == expected:
            break
        time.sleep(0.05)
    return status


def test_admin_settings_take_effect_on_reload(fleet: list[dict[str, Any]]) -> None:
    with running_proxy({"backends": fleet, "admin": {"token": TOKEN}}) as proxy:
        reloaded = admin(proxy.url, "POST", "reload").json()
        _reload(proxy, {"admin": {"enabled": False, "token": TOKEN}})
        closed = _status_until(proxy.url, 404, ADMIN)
        _reload(proxy, {"admin": {"token": "another-token"}})
        reopened = _status_until(proxy.url, 200, {"authorization": "Bearer another-token"})
        old = admin(proxy.url, "GET", "backends").status_code
    assert reloaded["needs_restart"] == []
    assert closed == 404  # enabled: false applies without a restart
    assert reopened == 200 and old == 401
