"""The client side of the live qos_drl evaluation (`bench.studies.qos.live`): Poisson arrivals
of held-out prompts sent to the proxy's expert group, QoS as the client sees it.

A request asks for the longest real answer among the experts (`ignore_eos`); the
expert that serves it (`x-laneway-backend`) fixes how many tokens d it needs: that
expert's real answer length. The client stops reading and closes the stream at the
d-th token, so the backend does that expert's work (the proxy cancels the upstream
on disconnect). Latency per token = (arrival of the d-th token - send) / d; QoS =
that expert's real score · 1[lpt ≤ L]; a 503 `request_dropped` is a drop (QoS 0).
Tokens are counted from `token_ids` (`return_token_ids`): vLLM may pack several
into one event under load.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from bench.studies.qos.sim import PoolPrompt, TraceArrivals
from policies.qos_drl.impact import qos

GROUP = "experts"  # the request model: a model group over every expert


@dataclass(frozen=True, slots=True)
class LiveRequest:
    seq: int
    arrival_s: float  # offset from the start of the run
    prompt: PoolPrompt
    text: str
    max_tokens: int  # the longest (capped) real answer over the experts


@dataclass(frozen=True, slots=True)
class LiveRecord:
    seq: int
    prompt_id: int
    expert: int  # index of the serving expert; -1: dropped or failed before a backend
    dropped: bool
    error: str | None
    needed: int  # d: the serving expert's real answer length (capped)
    lpt_s: float | None  # latency per token; None unless d tokens arrived
    score: float
    qos: float


def schedule(pool: Sequence[PoolPrompt], texts: Mapping[int, str], rate: float,
             arrivals: int, seed: int, cap: int | None = None,
             trace: TraceArrivals | None = None) -> list[LiveRequest]:
    """The simulator's arrivals (QosSim.reset/arrive): with the same seed (and `trace`),
    the same prompts at the same offsets as `bench.studies.qos.bench_qos`
    (`bench.studies.qos.trace`)."""
    rng, now, out = random.Random(seed), 0.0, []
    gaps = trace.draw(seed, rate) if trace is not None else []
    for seq in range(arrivals):
        now += gaps[seq % len(gaps)] if gaps else rng.expovariate(rate)
        prompt = rng.choice(pool)
        out.append(LiveRequest(seq, now, prompt, texts[prompt.id],
                               capped(max(prompt.lengths), cap)))
    return out


def capped(tokens: int, cap: int | None) -> int:
    return tokens if cap is None else min(tokens, cap)


def token_count(event: bytes) -> int:
    """Generated tokens in one SSE `data:` payload (0 for the usage event)."""
    choices = orjson.loads(event).get("choices") or ()
    ids = [c.get("token_ids") for c in choices]
    if any(i is not None for i in ids):
        return sum(len(i or ()) for i in ids)
    return sum(1 for c in choices if c.get("text") or (c.get("delta") or {}).get("content"))


def account(request: LiveRequest, expert: int, needed: int, sent: float,
            reached: float | None, limit_s: float, error: str | None = None) -> LiveRecord:
    """The record of a request served by `expert` whose d-th token arrived at `reached`
    (None: it never did, QoS 0)."""
    score = request.prompt.scores[expert]
    lpt = None if reached is None else (reached - sent) / needed
    return LiveRecord(request.seq, request.prompt.id, expert, False, error, needed, lpt,
                      score, 0.0 if lpt is None else qos(score, lpt, limit_s))


def is_drop(status: int, body: bytes) -> bool:
    """The policy's drop: 503 with the OpenAI error code `request_dropped`."""
    try:
        error = orjson.loads(body).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return status == 503 and isinstance(error, dict) and error.get("code") == "request_dropped"


def failed(request: LiveRequest, dropped: bool, error: str | None) -> LiveRecord:
    return LiveRecord(request.seq, request.prompt.id, -1, dropped, error, 0, None, 0.0, 0.0)


async def send_one(session: aiohttp.ClientSession, url: str, request: LiveRequest,
                   experts: Mapping[str, int], cap: int | None, limit_s: float) -> LiveRecord:
    """Send now; never raises for request failures (they are recorded)."""
    body = {"model": GROUP, "prompt": request.text, "max_tokens": request.max_tokens,
            "ignore_eos": True, "stream": True, "return_token_ids": True, "temperature": 0}
    sent = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                text = await response.content.read(2000)
                dropped = is_drop(response.status, text)
                return failed(request, dropped, None if dropped else
                              f"HTTP {response.status}: {text.decode(errors='replace')}")
            expert = experts[response.headers.get("x-laneway-backend", "")]
            needed = capped(request.prompt.lengths[expert], cap)
            seen = 0
            async for line in response.content:
                if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                    seen += token_count(line[5:])
                if seen >= needed:
                    reached = time.perf_counter()
                    response.close()  # the proxy cancels the upstream: the work ends here
                    return account(request, expert, needed, sent, reached, limit_s)
            return account(request, expert, needed, sent, None, limit_s,
                           f"stream ended after {seen} of {needed} tokens")
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
        return failed(request, False, f"{type(exc).__name__}: {exc}")


async def replay(url: str, requests: Sequence[LiveRequest], experts: Mapping[str, int],
                 cap: int | None, limit_s: float, timeout_s: float = 900.0
                 ) -> list[LiveRecord]:
    """Send every request at its arrival offset (open loop); wait for all."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout, read_bufsize=1 << 20) as session:

        async def one(request: LiveRequest) -> LiveRecord:
            await asyncio.sleep(max(0.0, start + request.arrival_s - loop.time()))
            return await send_one(session, url, request, experts, cap, limit_s)

        return list(await asyncio.gather(*(one(r) for r in requests)))
