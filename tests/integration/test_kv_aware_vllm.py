"""kv_aware end to end: two real vLLM-CPU servers of the small tiny model publishing
KV cache events, behind `laneway serve` with policy kv_aware. A long system prompt
is sent to one server directly (the proxy never routed it, so its approximate
prefix memory knows nothing); chat requests sharing that prefix then go through the
proxy to that server, every time, while the least-loaded tie-break would alternate.

The servers get concrete `tcp://127.0.0.1:port` endpoints, so vLLM connects and the
proxy binds (`bind: true`; docs/kv_events.md).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.harness.ports import free_port
from bench.harness.proxy_process import running_proxy
from bench.models.backends import Running, Spec, start, stop

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32
SEED = "4242"


def _system(topic: str) -> str:
    return " ".join(f"Rule {i}: the {topic} keeper logs wave {i} before the tide turns."
                    for i in range(24))


def _server(name: str) -> tuple[Spec, dict[str, Any]]:
    endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    vllm_kv = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
               "endpoint": endpoint, "replay_endpoint": replay}
    spec = Spec(name, "small", "tiny-llama", free_port(),
                extra_args=("--enable-prefix-caching", "--block-size", str(BLOCK_SIZE),
                            "--kv-events-config", json.dumps(vllm_kv)),
                env=(("PYTHONHASHSEED", SEED),))
    return spec, {"endpoint": endpoint, "replay_endpoint": replay, "topic": "kv",
                  "bind": True, "hash_algo": "sha256", "hash_seed": SEED,
                  "block_size": BLOCK_SIZE}


def _chat(question: str, topic: str = "lighthouse") -> dict[str, Any]:
    return {"model": "tiny-llama", "max_tokens": 2,
            "messages": [{"role": "system", "content": _system(topic)},
                         {"role": "user", "content": question}]}


def _metric(text: str, name: str, backend: str) -> float:
    prefix = f'{name}{{backend="{backend}"}} '
    return next((float(line[len(prefix):]) for line in text.splitlines()
                 if line.startswith(prefix)), 0.0)


async def _prefix_routing(client: httpx.AsyncClient, proxy_url: str,
                          metrics: Callable[[], Awaitable[str]], holder: Running,
                          topic: str) -> list[str]:
    """Send `topic`'s system prompt to `holder` directly, wait until the proxy's index
    has its blocks, then send three questions under it through the proxy: where each
    went."""
    before = _metric(await metrics(), "laneway_kv_index_blocks", holder.name)
    direct = await client.post(holder.url + "/v1/chat/completions",
                               json=_chat("What is rule 3?", topic))
    assert direct.status_code == 200, direct.text
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # its BlockStored events reached the index
        if _metric(await metrics(), "laneway_kv_index_blocks", holder.name) >= before + 8:
            break
        await asyncio.sleep(0.2)
    routed = []
    for question in ("What is rule 7?", "Which rule mentions wave 12?", "Summarize."):
        answer = await client.post(proxy_url + "/v1/chat/completions",
                                   json=_chat(question, topic))
        assert answer.status_code == 200, answer.text
        routed.append(answer.headers["x-laneway-backend"])
    return routed


async def test_a_shared_prefix_goes_where_it_is_cached(tmp_path: Path) -> None:
    specs = [_server(name) for name in ("kv-a", "kv-b")]
    servers = await asyncio.to_thread(start, [spec for spec, _ in specs], timeout_s=240)
    config = {"backends": [{"name": s.name, "url": s.url, "model": "tiny-llama",
                            "kv_events": kv} for s, (_, kv) in zip(servers, specs, strict=True)],
              "policy": {"name": "kv_aware", "params": {"min_match_tokens": BLOCK_SIZE}},
              "poller": {"interval_s": 0.5}, "debug": {"log_decisions": True}}
    try:
        log_path = tmp_path / "proxy.log"
        with running_proxy(config, ready_timeout_s=60, log_path=log_path) as proxy:
            async with httpx.AsyncClient(timeout=120) as client:
                async def metrics() -> str:
                    return (await client.get(proxy.url + "/metrics")).text

                # each server connects to the proxy on its own schedule: probe each one
                # directly until the proxy has heard its events
                for attempt in range(30):
                    for server in servers:
                        await client.post(server.url + "/v1/completions", json={
                            "model": "tiny-llama", "max_tokens": 1,
                            "prompt": f"Probe {attempt} {server.name}: " + "sea " * 80})
                    text = await metrics()
                    if all(_metric(text, "laneway_kv_events_total", s.name) > 0
                           for s in servers):
                        break
                    await asyncio.sleep(0.5)
                text = await metrics()
                assert all(_metric(text, "laneway_kv_events_total", s.name) > 0
                           for s in servers), text

                # each server in turn holds a prefix the proxy never routed: the least-
                # loaded turn-taking (or the approximation) would send half of them away
                for holder, topic in ((servers[1], "lighthouse"), (servers[0], "harbour")):
                    routed = await _prefix_routing(client, proxy.url, metrics, holder, topic)
                    assert routed == [holder.name] * 3
                decisions = [line for line in log_path.read_text().splitlines()
                             if " -> kv-" in line and "prefix tokens" in line]
                assert sum(f"prefix tokens cached on {s.name}" in line for line in decisions
                           for s in servers) == 6, decisions

                # a prompt sharing nothing is not drawn to it: least loaded, taking turns
                others = []
                for i in range(2):
                    answer = await client.post(proxy.url + "/v1/completions", json={
                        "model": "tiny-llama", "max_tokens": 1,
                        "prompt": f"Unrelated {i}: " + "zebra crossing " * 60})
                    others.append(answer.headers["x-laneway-backend"])
                assert set(others) == {s.name for s in servers}
    finally:
        await asyncio.to_thread(stop, servers)
