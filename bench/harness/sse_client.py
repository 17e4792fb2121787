"""One streamed chat completion, timed per SSE event, read raw with aiohttp.

Raw SSE (not the openai SDK) gives exact arrival times per event and the proxy's
comment lines: with `x-laneway-events: 1` laneway reports a migration as
`: laneway {"event": "migrated", "from": A, "to": B, "at_token": N, "reason": ...}`.
vLLM may pack several tokens into one event under load, so token counts come from
`usage` (`stream_options.include_usage`), never from counting events.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.harness.results import Migration, RequestResult
from bench.harness.workloads import WorkloadRequest
from bench.models.lexicon import CHAT_TEMPLATE_TOKENS

EVENT_PREFIX = b": laneway "
_ERROR_BODY_LIMIT = 2000


@dataclass(frozen=True, slots=True)
class Target:
    url: str  # base URL of the proxy (or of one backend), without /v1
    model: str
    timeout_s: float = 600.0
    headers: tuple[tuple[str, str], ...] = ()  # sent with every request
    # ask for this many tokens and stop reading at the request's own length, so the
    # proxy's length prediction is not capped at the true length (None: ask for it)
    hide_length: int | None = None


def request_body(target: Target, request: WorkloadRequest) -> dict[str, Any]:
    # ignore_eos: every request produces exactly max_tokens, whichever backend runs it;
    # temperature 0 keeps outputs equal across runs (and across a migration).
    body = {"model": target.model, "messages": [{"role": "user", "content": request.prompt}],
            "max_tokens": request.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0}
    if target.hide_length is not None:  # token ids count what arrived (the reader stops)
        body.update(max_tokens=max(target.hide_length, request.max_tokens),
                    return_token_ids=True)
    return body


def request_headers(target: Target, request: WorkloadRequest) -> dict[str, str]:
    headers = {"x-laneway-events": "1", "x-request-id": f"bench-{request.seq}-{request.id}",
               **dict(target.headers)}
    if request.slo_s is not None:
        headers["x-laneway-slo-ms"] = f"{request.slo_s * 1000:.0f}"
    # the true length as the client's hint: read by goodput's oracle variant only
    # (`length_source: hint`), which --hide-length leaves with max_tokens hidden
    headers["x-laneway-expected-tokens"] = str(request.max_tokens)
    return headers


@dataclass(slots=True)
class _Observed:
    """What arrives on one stream, while it arrives (local to one request)."""

    sent: float
    chunk_times: list[float] = field(default_factory=list)
    migrations: list[Migration] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    done: bool = False
    tokens: int = 0  # token ids received (requests sent with return_token_ids)

    def line(self, line: bytes, now: float) -> None:
        if line.startswith(EVENT_PREFIX):
            self._comment(orjson.loads(line[len(EVENT_PREFIX):]), now)
        elif line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
            else:
                self._event(orjson.loads(payload), now)

    def _comment(self, event: dict[str, Any], now: float) -> None:
        if event.get("event") == "migrated":
            self.migrations.append(Migration(str(event.get("from")), str(event.get("to")),
                                             event.get("at_token"), str(event.get("reason", "")),
                                             now - self.sent))

    def _event(self, event: dict[str, Any], now: float) -> None:
        if "error" in event:
            error = event["error"]
            self.error = str(error.get("message") if isinstance(error, dict) else error)
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            self.tokens += len(choice.get("token_ids") or ())
        for choice in event.get("choices") or ():
            if (choice.get("delta") or {}).get("content") or choice.get("text"):
                self.chunk_times.append(now - self.sent)
                break


async def stream_one(session: aiohttp.ClientSession, target: Target,
                     request: WorkloadRequest, run_start: float,
                     deadline: float | None = None) -> RequestResult:
    """Send `request` now; never raises for request failures (they are recorded).

    `deadline` (event-loop time) cuts the request: it is recorded as an error.
    """
    observed = _Observed(time.perf_counter())
    status: int | None = None
    backend: str | None = None
    try:
        async with asyncio.timeout_at(deadline), session.post(
                f"{target.url}/v1/chat/completions", json=request_body(target, request),
                headers=request_headers(target, request),
                timeout=aiohttp.ClientTimeout(total=target.timeout_s)) as response:
            status, backend = response.status, response.headers.get("x-laneway-backend")
            if status != 200:
                body = await response.content.read(_ERROR_BODY_LIMIT)
                observed.error = f"HTTP {status}: {body.decode(errors='replace')}"
            else:
                stop_at = request.max_tokens if target.hide_length is not None else None
                async for raw in response.content:
                    observed.line(raw.rstrip(b"\r\n"), time.perf_counter())
                    if stop_at is not None and observed.tokens >= stop_at:
                        ended = time.perf_counter()
                        response.close()  # the proxy cancels the upstream: the work ends
                        observed.done = True
                        return _result(request, target, observed, ended, run_start, status,
                                       backend)
                if not observed.done and observed.error is None:
                    observed.error = "stream ended without [DONE]"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        cut = deadline is not None and asyncio.get_running_loop().time() >= deadline
        observed.error = "cut at the run's time limit" if cut else f"{type(exc).__name__}: {exc}"
    return _result(request, target, observed, time.perf_counter(), run_start, status, backend)


def _result(request: WorkloadRequest, target: Target, observed: _Observed, ended: float,
            run_start: float, status: int | None, backend: str | None) -> RequestResult:
    e2e = ended - observed.sent
    ttft = observed.chunk_times[0] if observed.chunk_times else None
    output_tokens = observed.usage.get("completion_tokens") or observed.tokens or None
    prompt_tokens = observed.usage.get("prompt_tokens")
    if prompt_tokens is None and observed.tokens:  # stopped before the usage event
        prompt_tokens = request.prompt_tokens + CHAT_TEMPLATE_TOKENS
    # From the first to the last text event: the wait for `[DONE]` is not decoding.
    tpot = (observed.chunk_times[-1] - observed.chunk_times[0]) / (output_tokens - 1) \
        if observed.chunk_times and output_tokens and output_tokens > 1 else None
    return RequestResult(
        request.seq, request.id, target.model, request.arrival_s, observed.sent - run_start,
        e2e, ttft, tpot, tuple(observed.chunk_times), prompt_tokens,
        output_tokens, request.max_tokens, backend, status, observed.error,
        tuple(observed.migrations), request.slo_s, request.source, request.quality)
