"""Non-streamed latency of two laneway checkouts, A/B in one run.

`python -m bench.harness.latency_ab BASE_DIR [NEW_DIR]`: the companion of `bench.harness.cpu_ab`
for a
change to the whole-answer path. One unpaced fake vLLM, a `laneway serve` in front of
it from each checkout (`git worktree add /tmp/base <commit>`), then `--rounds` blocks
of `--requests` sequential chat requests (16 tokens, not streamed) through each in
turn, the order alternating between rounds; reports p50 and p99 of each side over
all its blocks.
"""

from __future__ import annotations

import asyncio
import sys
import time

import aiohttp

from bench.harness.cpu_ab import checkouts_parser, proxy_from
from bench.studies.overhead_procs import fake_process

_BODY = b'{"model":"fast","max_tokens":16,"messages":[{"role":"user","content":"hi"}]}'
_JSON = {"content-type": "application/json"}


async def block(http: aiohttp.ClientSession, url: str, requests: int) -> list[float]:
    """Milliseconds of each of `requests` sequential requests."""
    took = []
    for _ in range(requests):
        started = time.perf_counter()
        async with http.post(url + "/v1/chat/completions", data=_BODY, headers=_JSON) as got:
            await got.read()
            assert got.status == 200, got.status
        took.append((time.perf_counter() - started) * 1000)
    return took


async def rounds(a: str, b: str, n: int, requests: int) -> tuple[list[float], list[float]]:
    got: tuple[list[float], list[float]] = ([], [])
    async with aiohttp.ClientSession() as http:
        for url in (a, b):  # warm both
            await block(http, url, requests)
        for i in range(n):
            for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                got[side].extend(await block(http, (a, b)[side], requests))
    return got


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = checkouts_parser(__doc__, rounds=10)
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args(argv)
    with fake_process(0, "fast") as fast, fake_process(20.0, "paced") as paced, \
            proxy_from(args.base, fast, paced, True) as a, \
            proxy_from(args.new, fast, paced, True) as b:
        base, new = asyncio.run(rounds(a.url, b.url, args.rounds, args.requests))
    for name, values in (("A " + str(args.base), base), ("B " + str(args.new), new)):
        print(f"{name}: p50 {quantile(values, 0.5):.3f} ms, p99 {quantile(values, 0.99):.3f} ms"
              f" ({len(values)} requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
