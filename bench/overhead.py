"""`make bench-overhead`: what the proxy adds, against the same fake called directly.

In one run: two fake vLLM servers (one unpaced, one paced at 20 ms/token) and
`laneway serve` in front of them, each its own process; the load generator (aiohttp
on uvloop) alternates direct and proxied blocks so drift hits both alike. Reports
added latency p50/p99 (non-streamed, and TTFT of streams), streamed tokens/s at 1,
64 and 256 concurrent paced streams (ratio proxy/direct), and the proxy's CPU µs
per relayed token (from /proc, the figure that does not depend on sharing the
cores with the load generator).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench.proxy_process import free_port, running_proxy

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"added_p50_ms": 1.0, "added_p99_ms": 3.0, "throughput_ratio_256": 0.95}


@contextlib.contextmanager
def fake_process(tpot_ms: float, model: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.fake_vllm", "--port", str(port), "--model", model,
         "--tpot-ms", str(tpot_ms)], cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("fake vLLM did not start")
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def latencies(http: aiohttp.ClientSession, url: str, model: str, n: int,
                    stream: bool) -> list[float]:
    """Sequential requests; seconds to the full body (or to the first chunk if stream)."""
    body = {"model": model, "prompt": "hi", "max_tokens": 1 if not stream else 4,
            "stream": stream}
    out = []
    for _ in range(n):
        started = time.perf_counter()
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            if stream:
                await resp.content.readany()
                out.append(time.perf_counter() - started)
                await resp.read()
            else:
                await resp.read()
                out.append(time.perf_counter() - started)
    return out


async def stream_tokens(http: aiohttp.ClientSession, url: str, model: str, tokens: int) -> int:
    body = {"model": model, "prompt": "hi", "max_tokens": tokens, "stream": True}
    seen = 0
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        async for chunk in resp.content.iter_any():
            seen += chunk.count(b"data: ")
    return seen - 1  # [DONE]


async def throughput(http: aiohttp.ClientSession, url: str, model: str, streams: int,
                     tokens: int) -> tuple[float, int]:
    started = time.perf_counter()
    counts = await asyncio.gather(*(stream_tokens(http, url, model, tokens)
                                    for _ in range(streams)))
    total = sum(counts)
    return total / (time.perf_counter() - started), total


@dataclass
class Legs:
    direct_fast: str
    direct_paced: str
    proxy: str
    proxy_pid: int
    floor: str  # bench.minimal_relay in front of the paced fake
    floor_pid: int


@contextlib.contextmanager
def minimal_relay(upstream: str) -> Iterator[tuple[str, int]]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.minimal_relay", upstream, str(port)],
                            cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.TransportError):
                httpx.get(url, timeout=1)
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("minimal relay did not start")
            time.sleep(0.05)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def measure(legs: Legs, n: int, concurrency: list[int], tokens: int,
                  repeat: int) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as http:
        await latencies(http, legs.proxy, "fast", 50, False)  # warm up both legs
        await latencies(http, legs.direct_fast, "fast", 50, False)
        result: dict[str, Any] = {}
        for stream, key in ((False, "non_stream"), (True, "ttft")):
            direct: list[float] = []
            proxied: list[float] = []
            for _ in range(10):  # alternate blocks so drift hits both legs alike
                direct += await latencies(http, legs.direct_fast, "fast", n // 10, stream)
                proxied += await latencies(http, legs.proxy, "fast", n // 10, stream)
            result[key] = {
                "direct_p50_ms": pct(direct, 0.5) * 1e3, "proxy_p50_ms": pct(proxied, 0.5) * 1e3,
                "direct_p99_ms": pct(direct, 0.99) * 1e3, "proxy_p99_ms": pct(proxied, 0.99) * 1e3,
                "added_p50_ms": (pct(proxied, 0.5) - pct(direct, 0.5)) * 1e3,
                "added_p99_ms": (pct(proxied, 0.99) - pct(direct, 0.99)) * 1e3,
            }
        idle_cpu_per_s = await idle_cpu_rate(legs.proxy_pid)
        result["proxy_idle_cpu_percent"] = idle_cpu_per_s * 100
        result["streaming"] = {}
        for streams in concurrency:
            runs = [await streaming_pair(http, legs, streams, tokens, idle_cpu_per_s)
                    for _ in range(repeat)]
            runs.sort(key=lambda run: run["ratio"])
            result["streaming"][str(streams)] = {**runs[len(runs) // 2],
                                                 "ratios": [r["ratio"] for r in runs]}
        # The stack's floor at the highest concurrency: same load, bare relay.
        cpu_before = cpu_seconds(legs.floor_pid)
        _, relayed = await throughput(http, legs.floor, "paced", concurrency[-1], tokens)
        result["floor_relay_cpu_us_per_token"] = (
            (cpu_seconds(legs.floor_pid) - cpu_before) / max(1, relayed) * 1e6)
        return result


async def streaming_pair(http: aiohttp.ClientSession, legs: Legs, streams: int, tokens: int,
                         idle_cpu_per_s: float) -> dict[str, float]:
    """One direct and one proxied run of `streams` concurrent paced streams."""
    direct_tps, _ = await throughput(http, legs.direct_paced, "paced", streams, tokens)
    cpu_before, started = cpu_seconds(legs.proxy_pid), time.perf_counter()
    proxy_tps, relayed = await throughput(http, legs.proxy, "paced", streams, tokens)
    cpu = cpu_seconds(legs.proxy_pid) - cpu_before
    # The poller's scrapes cost CPU whether or not tokens flow: report the relay's
    # own share too.
    relay_cpu = cpu - idle_cpu_per_s * (time.perf_counter() - started)
    return {
        "direct_tokens_per_s": direct_tps, "proxy_tokens_per_s": proxy_tps,
        "ratio": proxy_tps / direct_tps,
        "proxy_cpu_us_per_token": cpu / max(1, relayed) * 1e6,
        "relay_cpu_us_per_token": max(0.0, relay_cpu) / max(1, relayed) * 1e6,
    }


async def idle_cpu_rate(pid: int, seconds: float = 3.0) -> float:
    """The proxy's CPU seconds per second with no traffic (its poller)."""
    before = cpu_seconds(pid)
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - before) / seconds


def table(result: dict[str, Any]) -> str:
    lines = ["| measure | direct | via laneway | added / ratio |", "|---|---|---|---|"]
    for key, label in (("non_stream", "non-streamed latency"), ("ttft", "streamed TTFT")):
        r = result[key]
        for q in ("p50", "p99"):
            lines.append(f"| {label} {q} | {r[f'direct_{q}_ms']:.2f} ms | "
                         f"{r[f'proxy_{q}_ms']:.2f} ms | +{r[f'added_{q}_ms']:.2f} ms |")
    for streams, r in result["streaming"].items():
        lines.append(f"| {streams} streams @20 ms/token | {r['direct_tokens_per_s']:.0f} tok/s | "
                     f"{r['proxy_tokens_per_s']:.0f} tok/s | {r['ratio']:.3f}x; proxy CPU "
                     f"{r['proxy_cpu_us_per_token']:.0f} µs/token, relay alone "
                     f"{r['relay_cpu_us_per_token']:.0f} µs/token |")
    lines.append(f"| bare uvicorn + aiohttp relay (floor), {list(result['streaming'])[-1]} "
                 f"streams | | | {result['floor_relay_cpu_us_per_token']:.0f} CPU µs/token |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000, help="per latency measure")
    parser.add_argument("--tokens", type=int, default=100, help="tokens per paced stream")
    parser.add_argument("--concurrency", default="1,64,256")
    parser.add_argument("--repeat", type=int, default=3, help="streaming runs; median kept")
    parser.add_argument("--quick", action="store_true", help="a small, fast run")
    parser.add_argument("--json", type=Path, default=REPO / "docs" / "results" / "overhead.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.tokens, args.concurrency, args.repeat = 200, 20, "1,16", 1
    concurrency = [int(c) for c in args.concurrency.split(",")]
    with fake_process(0, "fast") as fast, fake_process(20, "paced") as paced:
        config = {"backends": [{"name": "fast", "url": fast, "model": "fast"},
                               {"name": "paced", "url": paced, "model": "paced"}],
                  "policy": {"name": "round_robin"}, "server": {"log_level": "warning"}}
        with running_proxy(config) as proxy, minimal_relay(paced) as (floor, floor_pid):
            legs = Legs(fast, paced, proxy.url, proxy.pid, floor, floor_pid)
            result = asyncio.run(measure(legs, args.requests, concurrency, args.tokens,
                                         args.repeat))
    result["targets"] = TARGETS
    result["command"] = "python -m bench.overhead " + " ".join(argv or sys.argv[1:])
    print(table(result))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
