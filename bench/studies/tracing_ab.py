"""`make bench STUDY=tracing`: what tracing costs, A/B in one run.

Two `laneway serve` of this checkout in front of the same fakes (bench/studies/overhead.py's: one
unpaced, one paced at 20 ms/token): A without tracing, B tracing every request
(`sample_ratio` 1, the most it can cost) to an OTLP/HTTP receiver in a process of its
own (bench/fakes/otlp_sink.py). Rounds alternate between them, the order swapped each round:
a block of sequential non-streamed chat requests (latency p50 and p99 over all blocks,
and the proxy's CPU per request from /proc), then streams at once (CPU per relayed
token). The machine's drift hits both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench.harness.cpu_ab import cpu_per_token, proxy_from
from bench.harness.latency_ab import block, quantile
from bench.harness.proxy_process import ProxyProcess
from bench.harness.results import publish
from bench.studies.overhead_load import cpu_seconds
from bench.studies.overhead_procs import fake_process, otlp_sink, proxy_for
from predictors.home import REPO
from proxy.asgi import Message, Receive, Scope, Send
from proxy.config import TracingConfig
from proxy.observability.access_log import NOTES, note
from proxy.observability.tracing import Tracing
from proxy.types import Backend

# Tracing everything keeps the proxy well inside its overhead budget (README, Proxy
# overhead: ≤ +1 ms p50 and ≤ +3 ms p99 over a direct call; untraced it adds ~0.5 / ~1).
TARGETS = {"added_p50_ms": 0.25, "added_p99_ms": 1.0}


async def rounds(sides: tuple[ProxyProcess, ProxyProcess], n: int, requests: int,
                 streams: int, tokens: int) -> list[dict[str, list[float]]]:
    got: list[dict[str, list[float]]] = [{"ms": [], "cpu_us_per_request": [],
                                          "cpu_us_per_token": []} for _ in sides]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for proxy in sides:  # warm both
            await block(http, proxy.url, requests // 4)
        for i in range(n):
            for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                proxy, mine = sides[side], got[side]
                before = cpu_seconds(proxy.pid)
                mine["ms"] += await block(http, proxy.url, requests)
                mine["cpu_us_per_request"].append(
                    (cpu_seconds(proxy.pid) - before) / requests * 1e6)
                mine["cpu_us_per_token"].append(
                    await cpu_per_token(http, proxy, streams, tokens))
    return got


def in_process_us(requests: int = 20_000) -> float:
    """CPU µs per request that tracing adds, in-process: a traced chat request (its span,
    one backend request's span with the `traceparent` made, the notes as attributes,
    both encoded) against the same request untraced; the export itself is not run."""
    tracing = Tracing(TracingConfig(otlp_endpoint="http://127.0.0.1:9/v1/traces",
                                    max_queued_spans=2 * requests))
    backend = Backend("b", "http://127.0.0.1:8100", "m")
    scope: dict[str, Any] = {"type": "http", "method": "POST",
                             "path": "/v1/chat/completions",
                             "headers": [(b"content-type", b"application/json")]}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        with tracing.attempt(backend, "POST", "/v1/chat/completions", {}) as (span, _):
            note(scope, model="m", policy="round_robin", prompt_tokens=12,
                 completion_tokens=64, request_id="req-1")
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"x-laneway-backend", b"b")]})
        if span is not None:
            span.end()

    async def sent(message: Message) -> None:
        pass

    async def received() -> Message:
        return {"type": "http.request"}

    async def run(traced: bool) -> float:
        started = time.process_time()
        for _ in range(requests):
            request: dict[str, Any] = dict(scope)
            if traced:
                await tracing.traced(app, request, received, sent)
            else:
                request[NOTES] = {}
                await app(request, received, sent)
        return time.process_time() - started

    untraced_s, traced_s = asyncio.run(run(False)), asyncio.run(run(True))
    return (traced_s - untraced_s) / requests * 1e6


def summary(side: dict[str, list[float]]) -> dict[str, float]:
    return {"p50_ms": quantile(side["ms"], 0.5), "p99_ms": quantile(side["ms"], 0.99),
            "cpu_us_per_request": statistics.mean(side["cpu_us_per_request"]),
            "cpu_us_per_token": statistics.mean(side["cpu_us_per_token"]),
            "requests": len(side["ms"])}


def table(result: dict[str, Any]) -> str:
    a, b = result["untraced"], result["traced"]
    rows = [("non-streamed latency p50", "p50_ms", "ms"), ("non-streamed latency p99", "p99_ms",
                                                            "ms"),
            ("proxy CPU per request", "cpu_us_per_request", "µs"),
            (f"proxy CPU per token, {result['streams']} streams", "cpu_us_per_token", "µs")]
    lines = ["| measure | untraced | traced (every request) | traced - untraced |",
             "|---|---|---|---|"]
    for label, key, unit in rows:
        lines.append(f"| {label} | {a[key]:.2f} {unit} | {b[key]:.2f} {unit} | "
                     f"{b[key] - a[key]:+.2f} {unit} |")
    lines.append(f"| tracing's own CPU per request, in-process (2 spans, encoded) | | | "
                 f"{result['in_process_cpu_us_per_request']:.1f} µs |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--traced-from", type=Path, default=REPO,
                        help="the traced proxy's checkout (a git worktree): another tracer")
    parser.add_argument("--json", type=Path, default=REPO / "docs" / "results" / "tracing.json")
    args = parser.parse_args(argv)
    with fake_process(0, "fast") as fast, fake_process(20.0, "paced") as paced, \
            otlp_sink() as traces, proxy_for(fast, paced) as untraced, \
            proxy_from(args.traced_from, fast, paced, True, traces) as traced:
        a, b = asyncio.run(rounds((untraced, traced), args.rounds, args.requests,
                                  args.streams, args.tokens))
        time.sleep(2)  # the last export
        received = httpx.get(f"{traces}/health", timeout=5).json()
    micro = in_process_us()
    untraced_s, traced_s = summary(a), summary(b)
    added = {key: traced_s[key.removeprefix("added_")] - untraced_s[key.removeprefix("added_")]
             for key in TARGETS}
    result = {"untraced": untraced_s, "traced": traced_s, "added": added, "targets": TARGETS,
              "traced_from": str(args.traced_from),
              "in_process_cpu_us_per_request": micro,
              "meets_targets": {k: added[k] <= TARGETS[k] for k in TARGETS},
              "rounds": args.rounds,
              "streams": args.streams, "tokens": args.tokens, "spans_received": received,
              "command": "python -m bench.studies.tracing_ab " + " ".join(
                  sys.argv[1:] if argv is None else argv)}
    publish(args.json, result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
