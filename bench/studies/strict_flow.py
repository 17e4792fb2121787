"""Strict flow control across replicas: is the limit held, and what does holding it cost?

Two fake vLLM backends (paced tokens; this process, so each one's peak of open
requests is exact) behind proxy processes sharing a real Redis, with
`max_inflight_per_backend` = 4 and closed-loop clients asking for far more (24
clients, non-streamed 16-token completions). Modes, in the same run and interleaved:
one replica taking every client (the reference: one queue, the limit exact), two
replicas without `strict` (each counts the other's requests as of the last sync), and
two with `strict` (slot leases in Redis). Clients split evenly over the two replicas,
or 20 / 4 (the leases must follow the demand); and a light load (6 clients, all on one
of two replicas, room for 8), where strict leases must not make requests wait.

    python -m bench.studies.strict_flow [--seconds 15] [--draws 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from bench.fakes.fake_vllm import FakeConfig, serve_fake
from bench.harness.proxy_process import running_proxy
from bench.harness.report import git_commit, pct
from bench.harness.services import running_redis

LIMIT = 4
CLIENTS = 24
LIGHT = 6
TOKENS = 16
FAKE = FakeConfig(ttft_s=0.03, tpot_s=0.02)
MODES = {  # name: (replicas, strict, clients on each replica)
    "one replica": (1, False, (CLIENTS,)),
    "two, loose, even": (2, False, (CLIENTS // 2, CLIENTS // 2)),
    "two, strict, even": (2, True, (CLIENTS // 2, CLIENTS // 2)),
    "two, loose, 20/4": (2, False, (20, 4)),
    "two, strict, 20/4": (2, True, (20, 4)),
    # light load: 6 clients, room for 8: nobody should wait
    "light: one replica": (1, False, (LIGHT,)),
    "light: two, loose, 6/0": (2, False, (LIGHT, 0)),
    "light: two, strict, 6/0": (2, True, (LIGHT, 0)),
}


async def _client(session: aiohttp.ClientSession, url: str, until: float,
                  e2es: list[float], errors: list[int]) -> None:
    body = {"model": "fake", "prompt": "Count:", "max_tokens": TOKENS, "ignore_eos": True}
    while time.monotonic() < until:
        started = time.monotonic()
        try:
            async with session.post(f"{url}/v1/completions", json=body) as response:
                await response.read()
                ok = response.status == 200
        except aiohttp.ClientError:
            ok = False
        if not ok:
            errors.append(1)
        elif time.monotonic() <= until:
            e2es.append(time.monotonic() - started)


@contextlib.contextmanager
def _proxies(redis_url: str, backends: list[str], replicas: int, strict: bool
             ) -> Iterator[list[str]]:
    cfg = {"backends": [{"name": f"f{i}", "url": url, "model": "fake"}
                        for i, url in enumerate(backends)],
           "policy": {"name": "least_request"}, "server": {"log_level": "warning"},
           "flow_control": {"max_inflight_per_backend": LIMIT, "strict": strict,
                            "queue_timeout_s": 60},
           "state": {"backend": "redis", "redis_url": redis_url}}
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(running_proxy(cfg)).url for _ in range(replicas)]


async def _run(mode: str, redis_url: str, seconds: float) -> dict[str, Any]:
    replicas, strict, split = MODES[mode]
    async with contextlib.AsyncExitStack() as stack:
        fakes = [await stack.enter_async_context(serve_fake(FAKE)) for _ in range(2)]
        urls = await asyncio.to_thread(
            stack.enter_context, _proxies(redis_url, [f.url for f in fakes], replicas,
                                          strict))
        await asyncio.sleep(0.5)  # the first leases
        e2es: list[float] = []
        errors: list[int] = []
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            until = time.monotonic() + seconds
            await asyncio.gather(*(_client(session, url, until, e2es, errors)
                                   for url, clients in zip(urls, split, strict=True)
                                   for _ in range(clients)))
        return {"completed_per_s": len(e2es) / seconds, "errors": len(errors),
                "e2e_p50_s": pct(e2es, 0.5) if e2es else None,
                "e2e_p99_s": pct(e2es, 0.99) if e2es else None,
                "peak_per_backend": max(f.app.stats.peak for f in fakes)}


async def _main(seconds: float, draws: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with running_redis() as redis_url:
        for draw in range(draws):
            order = list(MODES) if draw % 2 == 0 else list(reversed(MODES))
            for mode in order:
                result = await _run(mode, redis_url, seconds)
                print(f"draw {draw} {mode}: {result}", flush=True)
                runs[mode].append(result)
    table = {}
    for mode, results in runs.items():
        one = "light: one replica" if mode.startswith("light") else "one replica"
        reference = statistics.fmean(r["completed_per_s"] for r in runs[one])
        rate = statistics.fmean(r["completed_per_s"] for r in results)
        table[mode] = {
            "completed_per_s": round(rate, 2),
            "vs_one_replica": round(rate / reference, 3),
            "e2e_p50_s": round(statistics.fmean(r["e2e_p50_s"] for r in results), 3),
            "e2e_p99_s": round(statistics.fmean(r["e2e_p99_s"] for r in results), 3),
            "peak_per_backend": max(r["peak_per_backend"] for r in results),
            "errors": sum(r["errors"] for r in results)}
    return {"limit": LIMIT, "clients": CLIENTS, "tokens": TOKENS, "seconds": seconds,
            "draws": draws, "modes": table, "runs": runs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--draws", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/results/strict_flow.json"))
    args = parser.parse_args(argv)
    report = asyncio.run(_main(args.seconds, args.draws))
    report["command"] = "python -m bench.studies.strict_flow " + " ".join(
        sys.argv[1:] if argv is None else argv)
    report["commit"] = git_commit(short=True)
    print(f"{'mode':<24} {'req/s':>7} {'vs one':>7} {'p50 s':>6} {'p99 s':>6} {'peak':>5}")
    for mode, row in report["modes"].items():
        print(f"{mode:<24} {row['completed_per_s']:>7} {row['vs_one_replica']:>7} "
              f"{row['e2e_p50_s']:>6} {row['e2e_p99_s']:>6} {row['peak_per_backend']:>5}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
