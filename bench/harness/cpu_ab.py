"""CPU per relayed token of two laneway checkouts, A/B in one run.

`python -m bench.harness.cpu_ab BASE_DIR [NEW_DIR]`: one paced fake vLLM (20 ms/token), and a
`laneway serve` in front of it from each checkout (`git worktree add /tmp/base <commit>`
gives one; NEW_DIR defaults to this repository), started with that directory first on
PYTHONPATH. Rounds of `--streams` concurrent streams go through each in turn, the
order alternating between rounds, so machine drift hits both alike; reports each
round's CPU µs per relayed token from /proc (the proxy's whole process) and the
per-round differences. For a change to the per-token path, where one full overhead
run's noise (several µs) hides a change of a few per cent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from bench.harness.proxy_process import ProxyProcess
from bench.studies.overhead_load import cpu_seconds, throughput
from bench.studies.overhead_procs import fake_process, proxy_for
from predictors.home import REPO


@contextlib.contextmanager
def proxy_from(checkout: Path, fast: str, paced: str, tracking: bool,
               traces_url: str | None = None) -> Iterator[ProxyProcess]:
    """`proxy_for` with `checkout`'s code: the child starts in it (`python -m` puts its
    working directory first on sys.path) with it first on PYTHONPATH too."""
    before, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = str(checkout)
    os.chdir(checkout)
    try:
        running = proxy_for(fast, paced, tracking, traces_url)
        proxy = running.__enter__()
    finally:
        os.chdir(cwd)
        if before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = before
    try:
        yield proxy
    finally:
        running.__exit__(None, None, None)


async def cpu_per_token(http: aiohttp.ClientSession, proxy: ProxyProcess, streams: int,
                        tokens: int) -> float:
    before = cpu_seconds(proxy.pid)
    _, relayed, errors = await throughput(http, proxy.url, "paced", streams, tokens)
    if errors:
        raise RuntimeError(f"{len(errors)} streams failed: {errors[:2]}")
    return (cpu_seconds(proxy.pid) - before) / max(1, relayed) * 1e6


async def rounds(a: ProxyProcess, b: ProxyProcess, n: int, streams: int, tokens: int
                 ) -> tuple[list[float], list[float]]:
    got: tuple[list[float], list[float]] = ([], [])
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for proxy in (a, b):  # warm both (connections, first requests)
            await throughput(http, proxy.url, "paced", 16, 20)
        for i in range(n):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for side in order:
                got[side].append(await cpu_per_token(http, (a, b)[side], streams, tokens))
    return got


def checkouts_parser(doc: str | None, rounds: int) -> argparse.ArgumentParser:
    """The command line of an A/B of two checkouts: `base`, `new` and `--rounds`."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path, help="checkout A (e.g. a git worktree)")
    parser.add_argument("new", type=Path, nargs="?", default=REPO, help="checkout B")
    parser.add_argument("--rounds", type=int, default=rounds)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = checkouts_parser(__doc__, rounds=8)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--no-tracking", action="store_true",
                        help="migration off: the plain byte relay")
    args = parser.parse_args(argv)
    tracking = not args.no_tracking
    with fake_process(20.0, "paced") as paced, fake_process(0, "fast") as fast, \
            proxy_from(args.base, fast, paced, tracking) as a, \
            proxy_from(args.new, fast, paced, tracking) as b:
        base, new = asyncio.run(rounds(a, b, args.rounds, args.streams, args.tokens))
    for name, values in (("A " + str(args.base), base), ("B " + str(args.new), new)):
        print(f"{name}: mean {statistics.mean(values):.1f} µs/token; rounds "
              + ", ".join(f"{v:.1f}" for v in values))
    print(difference(base, new))
    return 0


def difference(base: list[float], new: list[float]) -> str:
    """B - A per token, absolute and relative, and in how many rounds B was lower."""
    diffs = [n - o for o, n in zip(base, new, strict=True)]
    # (a tiny run may measure no CPU tick at all on A: no relative change then)
    relative = (f"{statistics.mean(diffs) / statistics.mean(base):+.1%}"
                if statistics.mean(base) else "A measured 0")
    return (f"B - A: mean {statistics.mean(diffs):+.1f} µs/token ({relative}); lower in "
            f"{sum(d < 0 for d in diffs)} of {len(diffs)} rounds")


if __name__ == "__main__":
    sys.exit(main())
