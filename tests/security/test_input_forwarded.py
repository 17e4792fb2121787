"""Item 16: what only laneway may tell a backend is not passed through from the client:
the body's `priority`, `kv_transfer_params` and `laneway_*` `vllm_xargs`; the headers
`X-Forwarded-*`, `Forwarded`, `X-Vllm-Priority`, and those its `Connection` header names
(hop-by-hop)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from bench.harness.proxy_process import ProxyProcess, running_proxy
from tests.security.input_helpers import CHAT, Recorder, proxy_config


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ProxyProcess, Recorder]]:
    backend = Recorder()
    try:
        with running_proxy(proxy_config(backend.url)) as proxy:
            yield proxy, backend
    finally:
        backend.close()


def test_client_controls_do_not_reach_the_backend(
        served: tuple[ProxyProcess, Recorder]) -> None:
    proxy, backend = served
    body = {**CHAT, "priority": -100, "kv_transfer_params": {"do_remote_prefill": True},
            "vllm_xargs": {"laneway_tenant": "x", "mine": 1}, "temperature": 0.5}
    answer = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=10, headers={
        "x-forwarded-for": "6.6.6.6", "forwarded": "for=6.6.6.6", "x-vllm-priority": "-9",
        "connection": "keep-alive, x-hop", "x-hop": "secret", "x-kept": "yes"})
    assert answer.status_code == 200, answer.text
    headers, sent = backend.requests[-1]
    assert sent["vllm_xargs"] == {"mine": 1} and sent["temperature"] == 0.5
    assert "priority" not in sent and "kv_transfer_params" not in sent
    assert headers["x-kept"] == "yes"
    for name in ("x-forwarded-for", "forwarded", "x-vllm-priority", "x-hop"):
        assert name not in headers, name


def test_pass_through_routes_drop_them_too(served: tuple[ProxyProcess, Recorder]) -> None:
    proxy, backend = served
    answer = httpx.post(proxy.url + "/v1/embeddings", timeout=10,
                        json={"model": "fake", "input": "x", "priority": 5},
                        headers={"x-forwarded-host": "evil"})
    assert answer.status_code == 200, answer.text
    headers, sent = backend.requests[-1]
    assert "priority" not in sent and "x-forwarded-host" not in headers
