"""#71 part A, findings 2 and 10: what `POST /admin/backends` may add, which backends
get the operator's upstream key, and backend URLs with credentials in them. Against a
real `laneway serve`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.fakes.fake_vllm import FakeConfig, RunningFake
from bench.harness.proxy_process import running_proxy
from tests.security.admin_helpers import CHAT, TOKEN, admin, backends, fakes_in_thread

OPERATOR_KEY = "sk-operator-upstream-4a1b"


@pytest.fixture(scope="module")
def fakes() -> Iterator[list[RunningFake]]:
    with fakes_in_thread(FakeConfig(model="named"), FakeConfig()) as running:
        yield running


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data",  # cloud metadata
    "http://127.0.0.1:22",
    "http://[::1]:8000",
    "http://internal.example:8000",
])
def test_admin_adds_no_backend_outside_the_allowlist(fakes: list[RunningFake],
                                                     url: str) -> None:
    with running_proxy({"backends": backends(fakes[:1]),
                        "admin": {"token": TOKEN, "backend_allowlist": ["10.0.0.0/8"]}}
                       ) as proxy:
        added = admin(proxy.url, "POST", "backends",
                      json={"name": "x", "url": url, "model": "fake"})
        listed = [b["name"] for b in admin(proxy.url, "GET", "backends").json()["backends"]]
    assert added.status_code == 403 and added.json()["error"]["param"] == "url"
    assert listed == ["f0"]


def test_an_allowed_backend_added_by_admin_never_gets_the_upstream_key(
        fakes: list[RunningFake]) -> None:
    """A listener the admin API added must not receive the operator's key; the
    backends the config names still do."""
    named, added_fake = fakes
    config = {"backends": backends([named]), "upstream": {"api_key": OPERATOR_KEY},
              "admin": {"token": TOKEN, "backend_allowlist": ["127.0.0.0/8"]}}
    with running_proxy(config) as proxy:
        added = admin(proxy.url, "POST", "backends",
                      json={"name": "added", "url": added_fake.url, "model": "fake"})
        to_added = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, timeout=10)
        to_named = httpx.post(f"{proxy.url}/v1/chat/completions", timeout=10,
                              json={**CHAT, "model": "named"})
    assert added.status_code == 201
    assert to_added.status_code == 200 and to_added.headers["x-laneway-backend"] == "added"
    assert to_named.status_code == 200
    assert added_fake.app.stats.credentials  # it was sent the request, ...
    assert not any(OPERATOR_KEY in (c or "") for c in added_fake.app.stats.credentials)
    assert f"Bearer {OPERATOR_KEY}" in named.app.stats.credentials  # ... not the key


def test_backend_urls_with_credentials_are_refused_by_admin(
        fakes: list[RunningFake]) -> None:
    host = fakes[1].url.removeprefix("http://")
    with running_proxy({"backends": backends(fakes[:1]),
                        "admin": {"token": TOKEN, "backend_allowlist": ["127.0.0.0/8"]}}
                       ) as proxy:
        added = admin(proxy.url, "POST", "backends", json={
            "name": "creds", "url": f"http://user:hunter2@{host}", "model": "fake"})
        health = httpx.get(f"{proxy.url}/health", timeout=10).text
        listing = admin(proxy.url, "GET", "backends").text
    assert added.status_code == 400 and "credentials" in added.json()["error"]["message"]
    assert "hunter2" not in added.text + health + listing


def test_a_config_with_credentials_in_a_backend_url_does_not_start(
        fakes: list[RunningFake]) -> None:
    host = fakes[0].url.removeprefix("http://")
    entry: dict[str, Any] = {"name": "f0", "url": f"http://user:hunter2@{host}",
                             "model": "named"}
    with pytest.raises(RuntimeError, match="proxy exited") as failed, \
            running_proxy({"backends": [entry]}, ready_timeout_s=20):
        pass
    assert "credentials" in str(failed.value)
    assert "hunter2" not in str(failed.value)
