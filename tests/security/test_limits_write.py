"""Item 6: a client that never reads its stream loses it after `server.write_timeout_s`,
and with it everything the request held: the in-flight count and the flow-control slot
(the next request gets it)."""

from __future__ import annotations

import time

import httpx
import orjson

from bench.harness.proxy_process import running_proxy
from tests.security.input_helpers import CHAT, connect, fake_vllm, gauge, proxy_config

WRITE_TIMEOUT_S = 2.0
INFLIGHT = "laneway_backend_inflight"


def test_a_client_that_never_reads_frees_its_slot() -> None:
    with fake_vllm("--max-model-len", "200000") as fake_url:
        _never_read(fake_url)


def _never_read(fake_url: str) -> None:
    config = proxy_config(fake_url, server={"write_timeout_s": WRITE_TIMEOUT_S},
                          flow_control={"max_inflight_per_backend": 1,
                                        "queue_timeout_s": 30})
    with running_proxy(config) as proxy:
        body = orjson.dumps({**CHAT, "stream": True, "max_tokens": 100_000})
        with connect(proxy.url, rcvbuf=4096) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                         b"application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(body), body))
            deadline = time.monotonic() + 5
            while gauge(proxy.url, INFLIGHT) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert gauge(proxy.url, INFLIGHT) == 1  # the stream holds the one slot
            # the client reads nothing; the slot comes back within the write deadline
            deadline = time.monotonic() + WRITE_TIMEOUT_S + 10
            while gauge(proxy.url, INFLIGHT) > 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert gauge(proxy.url, INFLIGHT) == 0
            answer = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, timeout=10)
            assert answer.status_code == 200  # the freed slot serves the next request
