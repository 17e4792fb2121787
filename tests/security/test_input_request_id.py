"""Item 15: a client's `x-request-id` is echoed (and logged) only if short and plain;
any other is replaced by a new id; and it is never the key a request's state is kept
under (two requests may send the same one)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.harness.proxy_process import ProxyProcess, running_proxy
from tests.security.input_helpers import CHAT, fake_url, proxy_config

__all__ = ["fake_url"]


LOG: list[Path] = []


@pytest.fixture(scope="module")
def proxy(fake_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    log = tmp_path_factory.mktemp("log") / "proxy.log"
    LOG.append(log)
    with running_proxy(proxy_config(fake_url, server={"access_log": True}),
                       log_path=log) as proxy:
        yield proxy


def _chat(proxy: ProxyProcess, request_id: str) -> httpx.Response:
    return httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=10,
                      headers={"x-request-id": request_id})


@pytest.mark.parametrize("sent", ["r" * 20_000, 'a"b c', "ünï"])
def test_a_long_or_odd_id_is_replaced(proxy: ProxyProcess, sent: str) -> None:
    answer = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=10,
                        headers=[(b"x-request-id", sent.encode())])
    assert answer.status_code == 200
    echoed = answer.headers["x-request-id"]
    assert echoed != sent and echoed.startswith("lw-") and len(echoed) < 64


def test_a_plain_id_is_echoed(proxy: ProxyProcess) -> None:
    assert _chat(proxy, "job-42.a:1").headers["x-request-id"] == "job-42.a:1"


def test_a_shared_id_is_not_the_requests_key(proxy: ProxyProcess) -> None:
    # two requests with one id: each is logged with an id of its own besides it
    for _ in range(2):
        assert _chat(proxy, "same-id").headers["x-request-id"] == "same-id"
    log = LOG[-1].read_text().splitlines()
    own = [line.split("laneway_id=")[1].split()[0] for line in log
           if "request_id=same-id" in line and "laneway_id=" in line]
    assert len(own) == 2 and own[0] != own[1]
