"""Second review of #71: a client does not choose the data-parallel engine of a vLLM
with several (`X-data-parallel-rank`, which vLLM honours) any more than its priority
(`X-Vllm-Priority`). Against a real `laneway serve` and a backend that keeps what it
was sent."""

from __future__ import annotations

import httpx

from bench.harness.proxy_process import running_proxy
from tests.security.input_helpers import CHAT, Recorder, proxy_config


def test_a_clients_data_parallel_rank_does_not_reach_the_backend() -> None:
    backend = Recorder()
    try:
        with running_proxy(proxy_config(backend.url)) as proxy:
            for path, body in (("/v1/chat/completions", CHAT),
                               ("/v1/embeddings", {"model": "fake", "input": "hi"})):
                answer = httpx.post(proxy.url + path, json=body, timeout=10,
                                    headers={"X-data-parallel-rank": "0"})
                assert answer.status_code == 200, answer.text
    finally:
        backend.close()
    assert len(backend.requests) == 2
    for headers, _ in backend.requests:
        assert "x-data-parallel-rank" not in headers, headers
