"""ELDR on real vLLM-CPU MoE servers with the laneway_eldr plugin.

`collect` runs prompts and reads each request's record (prefill + decode expert
counts) from the plugin's side endpoint. `run_policy` is the two-stage PD flow the
paper describes, driven from here: a prefill leg (`max_tokens=1`, round robin over
the prefill pool) yields the signature, the policy picks a decode worker, and the
full request runs there (no KV transfer on CPU: the decode worker re-prefills).
Active experts per decode step come from the plugin's counters on every server.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import numpy as np

from bench.models.vllm_server import Running
from policies.base import Policy
from proxy.routing.eldr_stage import eldr_record
from proxy.types import Backend, ClusterView, Prediction, RequestContext

Embed = Callable[[np.ndarray], Prediction]
BATCHES = 65  # the plugin's batch-size buckets (0..64)


@dataclass(frozen=True, slots=True)
class PolicyRun:
    counters: np.ndarray  # plugin counter deltas, summed over servers (_decode_counters)
    tpot_s: list[float]
    route_ms: list[float]  # signature embedding + pick, in this process
    fetch_ms: list[float]  # the signature's round trip to the side endpoint

    @property
    def active_experts(self) -> float:
        """Mean distinct experts per decode step (per layer)."""
        return float(self.counters[1] / self.counters[0]) if self.counters[0] else float("nan")

    @property
    def batch(self) -> float:
        """Mean decode tokens per decode step."""
        return float(self.counters[2] / self.counters[0]) if self.counters[0] else float("nan")

    @property
    def steps_by_batch(self) -> np.ndarray:
        out: np.ndarray = self.counters[3:3 + BATCHES]
        return out

    @property
    def active_by_batch(self) -> np.ndarray:
        out: np.ndarray = self.counters[3 + BATCHES:]
        return out

    def merged(self, other: PolicyRun) -> PolicyRun:
        return PolicyRun(self.counters + other.counters, self.tpot_s + other.tpot_s,
                         self.route_ms + other.route_ms, self.fetch_ms + other.fetch_ms)


async def _complete(client: httpx.AsyncClient, server: Running, prompt: str,
                    max_tokens: int) -> tuple[str, float | None]:
    """Stream one completion; (request id, seconds per output token after the first).

    One retry when the server closed a pooled keep-alive connection as we reused it
    (uvicorn drops idle connections after 5 s; the request never started)."""
    try:
        return await _stream(client, server, prompt, max_tokens)
    except (httpx.ReadError, httpx.RemoteProtocolError):
        return await _stream(client, server, prompt, max_tokens)


async def _stream(client: httpx.AsyncClient, server: Running, prompt: str,
                  max_tokens: int) -> tuple[str, float | None]:
    request_id = uuid.uuid4().hex
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    stamps: list[float] = []
    async with client.stream("POST", f"{server.url}/v1/completions", json=body,
                             headers={"X-Request-Id": request_id}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return request_id, tpot


async def _record(client: httpx.AsyncClient, server: Running, request_id: str
                  ) -> dict[str, Any]:
    response = await client.get(f"{server.eldr_url}/eldr/requests/{request_id}")
    response.raise_for_status()
    found: dict[str, Any] = response.json()
    return found


async def collect(servers: Sequence[Running], prompts: Sequence[tuple[str, str]],
                  max_tokens: int, concurrency: int = 8) -> list[dict[str, Any]]:
    """Every prompt once (round robin), with its plugin record and domain."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i: int, domain: str, prompt: str) -> dict[str, Any]:
            server = servers[i % len(servers)]
            async with gate:
                request_id, _ = await _complete(client, server, prompt, max_tokens)
                return {"domain": domain, **await _record(client, server, request_id)}
        return await asyncio.gather(*(one(i, d, p) for i, (d, p) in enumerate(prompts)))


async def _decode_counters(client: httpx.AsyncClient, servers: Sequence[Running]
                           ) -> np.ndarray:
    """[3 + 2 * BATCHES]: steps, active-expert sum, decode tokens, then steps and
    active-expert sums per batch size; summed over the servers."""
    total = np.zeros(3 + 2 * BATCHES)
    for server in servers:
        text = (await client.get(f"{server.eldr_url}/metrics")).text
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith("laneway_eldr_")}
        total[:3] += [values["laneway_eldr_decode_steps_total"],
                      values["laneway_eldr_decode_active_experts_sum"],
                      values["laneway_eldr_decode_tokens_total"]]
        for b in range(BATCHES):
            total[3 + b] += values.get(f'laneway_eldr_decode_steps_by_batch{{batch="{b}"}}', 0)
            total[3 + BATCHES + b] += values.get(
                f'laneway_eldr_decode_active_experts_by_batch_sum{{batch="{b}"}}', 0)
    return total


async def run_policy(policy: Policy, servers: Sequence[Running], embed: Embed,
                     prompts: Sequence[tuple[str, str]], max_tokens: int,
                     concurrency: int) -> PolicyRun:
    candidates = tuple(Backend(s.name, s.url, s.model) for s in servers)
    by_name = {s.name: s for s in servers}
    inflight = dict.fromkeys(by_name, 0)
    tpot: list[float] = []
    route_ms: list[float] = []
    fetch_ms: list[float] = []
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i: int, domain: str, prompt: str) -> None:
            async with gate:
                prefill = servers[i % len(servers)]  # the prefill pool: round robin
                request_id, _ = await _complete(client, prefill, prompt, 1)
                started = time.perf_counter()
                record = await _record(client, prefill, request_id)
                fetch_ms.append((time.perf_counter() - started) * 1e3)
                started = time.perf_counter()
                prediction = embed(np.array(record["prefill"], float))
                context = RequestContext(request_id, "completions", "moe", prompt, (), True,
                                         max_tokens, session=domain)
                view = ClusterView(candidates, {}, dict(inflight), time.monotonic())
                name = policy.pick(context, prediction, view).backend.name
                route_ms.append((time.perf_counter() - started) * 1e3)
                inflight[name] += 1
                try:
                    _, seconds = await _complete(client, by_name[name], prompt, max_tokens)
                finally:
                    inflight[name] -= 1
                if seconds is not None:
                    tpot.append(seconds)
        before = await _decode_counters(client, servers)
        await asyncio.gather(*(one(i, d, p) for i, (d, p) in enumerate(prompts)))
        delta = await _decode_counters(client, servers) - before
    return PolicyRun(delta, tpot, route_ms, fetch_ms)


async def fetch_probe(server: Running, streams: int = 8, samples: int = 40
                      ) -> dict[str, float]:
    """The side endpoint's latency alone, read as the proxy's PD stage reads it
    (keep-alive aiohttp, `proxy/routing/eldr_stage.py`): a quiet client, the server decoding
    `streams` requests (the in-run figure also holds the bench client's busy event loop).
    """
    if server.eldr_url is None:
        raise ValueError(f"{server.name}: started without the ELDR plugin's side endpoint")
    async with httpx.AsyncClient(timeout=120) as client, aiohttp.ClientSession() as lookups:
        request_id, _ = await _complete(client, server, "hello there", 1)
        load = [asyncio.create_task(_complete(client, server, "x " * 50, 300))
                for _ in range(streams)]
        await asyncio.sleep(2.0)  # all decoding
        latencies = []
        for _ in range(samples):
            started = time.perf_counter()
            await eldr_record(lookups, server.eldr_url, request_id)
            latencies.append((time.perf_counter() - started) * 1e3)
        await asyncio.gather(*load)
    return {"p50": float(np.percentile(latencies, 50)),
            "p90": float(np.percentile(latencies, 90)), "decoding_streams": streams}
