"""The overhead benchmark's load generator (aiohttp) and its arithmetic.

Every measure runs the direct leg and the target leg in the same call, so the
figures are ratios or differences taken under the same machine conditions.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness.report import pct

CHAT_PATH = "/v1/chat/completions"
_BLOCKS = 10  # latency legs alternate in this many blocks, so drift hits both alike


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def chat_body(model: str, tokens: int, stream: bool, prompt: str = "hi") -> dict[str, Any]:
    """A chat completion of exactly `tokens` tokens (`ignore_eos`)."""
    return {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens, "ignore_eos": True, "stream": stream}


async def latencies(http: aiohttp.ClientSession, url: str, model: str, n: int,
                    stream: bool) -> list[float]:
    """Sequential requests; seconds to the whole body, or to the first token if `stream`."""
    body = chat_body(model, 4 if stream else 1, stream)
    out = []
    for _ in range(n):
        started = time.perf_counter()
        async with http.post(url + CHAT_PATH, json=body) as resp:
            resp.raise_for_status()
            if stream:
                # The role event and the first token leave the fake together.
                await resp.content.readuntil(b'"content":"tok')
                out.append(time.perf_counter() - started)
            await resp.read()
            if not stream:
                out.append(time.perf_counter() - started)
    return out


async def latency_legs(http: aiohttp.ClientSession, direct: str, target: str, n: int,
                       stream: bool) -> dict[str, float]:
    """p50/p99 in ms of `n` sequential requests on each leg, and what the target adds."""
    direct_s: list[float] = []
    target_s: list[float] = []
    block = max(1, n // _BLOCKS)
    for _ in range(max(1, n // block)):
        direct_s += await latencies(http, direct, "fast", block, stream)
        target_s += await latencies(http, target, "fast", block, stream)
    out = {}
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        out[f"direct_{name}_ms"] = pct(direct_s, q) * 1e3
        out[f"target_{name}_ms"] = pct(target_s, q) * 1e3
        out[f"added_{name}_ms"] = out[f"target_{name}_ms"] - out[f"direct_{name}_ms"]
    return out


async def stream_tokens(http: aiohttp.ClientSession, url: str, model: str, tokens: int
                        ) -> int | str:
    """Tokens received on one streamed chat completion (one SSE event each), or the
    error that ended it: a failure is a result of the benchmark, not a crash."""
    events = 0
    try:
        async with http.post(url + CHAT_PATH, json=chat_body(model, tokens, True)) as resp:
            if resp.status != 200:
                return f"HTTP {resp.status}: {(await resp.text())[:200]}"
            async for chunk in resp.content.iter_any():
                events += chunk.count(b"data: ")
    except aiohttp.ClientError as exc:
        return f"{type(exc).__name__}: {exc}"
    return max(0, events - 2)  # the role event and [DONE]


async def throughput(http: aiohttp.ClientSession, url: str, model: str, streams: int,
                     tokens: int) -> tuple[float, int, list[str]]:
    """(tokens/s over the wall time of `streams` concurrent streams, tokens received,
    errors of the streams that failed)."""
    started = time.perf_counter()
    outcomes = await asyncio.gather(*(stream_tokens(http, url, model, tokens)
                                      for _ in range(streams)))
    total = sum(o for o in outcomes if isinstance(o, int))
    errors = [o for o in outcomes if isinstance(o, str)]
    return total / (time.perf_counter() - started), total, errors


async def stream_legs(http: aiohttp.ClientSession, direct: str, target: str, streams: int,
                      tokens: int, target_pid: int | None, idle_rate: float
                      ) -> dict[str, Any]:
    """One direct and one target run of `streams` concurrent paced streams."""
    direct_tps, _, direct_errors = await throughput(http, direct, "paced", streams, tokens)
    cpu_before = cpu_seconds(target_pid) if target_pid else 0.0
    started = time.perf_counter()
    target_tps, relayed, target_errors = await throughput(http, target, "paced", streams,
                                                          tokens)
    cpu_us: float | None = None
    relay_us: float | None = None
    if target_pid:
        cpu = cpu_seconds(target_pid) - cpu_before
        # The poller's scrapes cost CPU whether or not tokens flow: the relay's share too.
        relay_cpu = cpu - idle_rate * (time.perf_counter() - started)
        cpu_us = cpu / max(1, relayed) * 1e6
        relay_us = max(0.0, relay_cpu) / max(1, relayed) * 1e6
    return {"direct_tokens_per_s": direct_tps, "target_tokens_per_s": target_tps,
            "ratio": target_tps / direct_tps, "tokens_relayed": relayed,
            "direct_failed_streams": len(direct_errors),
            "target_failed_streams": len(target_errors),
            "target_errors": sorted(set(target_errors))[:5],
            "target_cpu_us_per_token": cpu_us, "relay_cpu_us_per_token": relay_us}
