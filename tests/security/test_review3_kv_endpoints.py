"""Third review of #71: a backend the admin API adds may follow KV events only from
hosts `admin.backend_allowlist` lists, and may not make the proxy bind a socket. The
backend's URL was checked, its `kv_events` endpoints were not: the token holder could
have the proxy connect to any host and port, or (`bind: true`) open a listening
socket on any interface, where whoever reaches it feeds the exact index forged
events. Binding stays a config-file decision. Against a real `laneway serve`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bench.fakes.fake_vllm import FakeConfig, RunningFake
from bench.harness.proxy_process import running_proxy
from tests.security.admin_helpers import TOKEN, admin, backends, fakes_in_thread


@pytest.fixture(scope="module")
def fakes() -> Iterator[list[RunningFake]]:
    with fakes_in_thread(FakeConfig(), FakeConfig()) as running:
        yield running


def _add(fakes: list[RunningFake], kv_events: dict[str, Any]) -> tuple[int, Any, list[str]]:
    with running_proxy({"backends": backends(fakes[:1]),
                        "admin": {"token": TOKEN, "backend_allowlist": ["127.0.0.0/8"]}}
                       ) as proxy:
        added = admin(proxy.url, "POST", "backends", json={
            "name": "x", "url": fakes[1].url, "model": "fake", "kv_events": kv_events})
        listed = [b["name"] for b in admin(proxy.url, "GET", "backends").json()["backends"]]
    return added.status_code, added.json(), listed


@pytest.mark.parametrize("kv_events", [
    {"endpoint": "tcp://10.1.2.3:5557"},  # a host outside the allow-list
    {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://169.254.169.254:80"},
    {"endpoint": "tcp://127.0.0.1:5557", "bind": True},  # a socket the proxy opens
    {"endpoint": "ipc:///tmp/laneway-kv"},  # a local path, no host to check
])
def test_admin_follows_no_kv_events_outside_the_allowlist(fakes: list[RunningFake],
                                                          kv_events: dict[str, Any]) -> None:
    status, body, listed = _add(fakes, kv_events)
    assert status == 403 and body["error"]["param"] == "kv_events", body
    assert listed == ["f0"]


def test_admin_may_follow_an_allowed_hosts_events(fakes: list[RunningFake]) -> None:
    status, body, listed = _add(fakes, {"endpoint": "tcp://127.0.0.1:5557",
                                        "replay_endpoint": "tcp://127.0.0.1:5558"})
    assert status == 201, body
    assert listed == ["f0", "x"]
