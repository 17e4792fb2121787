"""A fast fake of a vLLM OpenAI server, for unit tests and the overhead benchmark.

Pure ASGI on uvicorn (uvloop + httptools). Tokens are `tok<i> `, paced by `tpot_s`
after `ttft_s`; SSE chunks are shaped like vLLM 0.32's and pre-encoded so the fake is
never the bottleneck. Failures can be injected (status, dropped connection, hang).
`/metrics` uses vLLM's metric names and counts what really runs here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn

from proxy.asgi import Receive, Scope, Send, send_bytes, send_json
from proxy.server import uvicorn_in_loop


@dataclass(frozen=True, slots=True)
class FakeConfig:
    model: str = "fake"
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    default_tokens: int = 16
    fail_status: int | None = None  # answer every completion request with this status
    fail_first: int | None = None  # ... or only the first N of them
    die_after_tokens: int | None = None  # drop the connection mid-stream
    hang: bool = False  # never answer a completion request


@dataclass(slots=True)
class FakeStats:
    requests: int = 0
    running: int = 0
    cancelled: int = 0
    finished: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    ttft_sum: float = 0.0
    ttft_count: int = 0
    itl_sum: float = 0.0
    itl_count: int = 0


class _Dropped(Exception):
    """Raised inside the app so uvicorn aborts a half-sent response."""


class FakeVllm:
    def __init__(self, config: FakeConfig) -> None:
        self.config = config
        self.stats = FakeStats()
        self.created = int(time.time())  # fixed, so equal requests get equal bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        path = scope["path"]
        if path == "/metrics":
            await send_bytes(send, 200, self._metrics(), [(b"content-type", b"text/plain")])
        elif path in ("/health", "/ping"):
            await send_bytes(send, 200, b"", [])
        elif path == "/v1/models":
            await send_json(send, 200, {"object": "list", "data": [
                {"id": self.config.model, "object": "model", "owned_by": "fake"}]})
        elif path in ("/v1/chat/completions", "/v1/completions"):
            await self._completion(path == "/v1/chat/completions", receive, send)
        else:
            await send_json(send, 404, {"error": {"message": "not found"}})

    async def _completion(self, chat: bool, receive: Receive, send: Send) -> None:
        body = orjson.loads(await _read(receive))
        stats, cfg = self.stats, self.config
        stats.requests += 1
        stats.bodies.append(body)
        if cfg.hang:
            await asyncio.Event().wait()
        if cfg.fail_status and (cfg.fail_first is None or stats.requests <= cfg.fail_first):
            await send_json(send, cfg.fail_status, {"error": {"message": "injected failure"}})
            return
        tokens = body.get("max_tokens") or cfg.default_tokens
        stats.running += 1
        try:
            if body.get("stream"):
                completed = await self._stream(chat, body, tokens, receive, send)
            else:
                await asyncio.sleep(cfg.ttft_s + cfg.tpot_s * max(0, tokens - 1))
                await send_json(send, 200, _full_body(chat, cfg.model, self.created, tokens, body))
                completed = True
            if completed:
                stats.finished += 1
        except asyncio.CancelledError:
            stats.cancelled += 1
            raise
        finally:
            stats.running -= 1

    async def _stream(
        self, chat: bool, body: dict[str, Any], tokens: int, receive: Receive, send: Send
    ) -> bool:
        """Stream `tokens` tokens; False if the client went away first."""
        cfg, stats = self.config, self.stats
        gone = asyncio.Event()
        watcher = asyncio.create_task(_watch(receive, gone))
        chunks = _Chunks(chat, cfg.model, self.created, bool(body.get("return_token_ids")))
        started = time.monotonic()
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await asyncio.sleep(cfg.ttft_s)
            if chat:
                await send({"type": "http.response.body", "body": chunks.role, "more_body": True})
            last = time.monotonic()
            stats.ttft_sum += last - started
            stats.ttft_count += 1
            for i in range(tokens):
                if gone.is_set():
                    stats.cancelled += 1
                    return False
                if cfg.die_after_tokens is not None and i == cfg.die_after_tokens:
                    raise _Dropped
                if i and cfg.tpot_s:
                    await asyncio.sleep(cfg.tpot_s)
                    now = time.monotonic()
                    stats.itl_sum += now - last
                    stats.itl_count += 1
                    last = now
                await send({"type": "http.response.body", "body": chunks.token(i),
                            "more_body": True})
            tail = chunks.finish(tokens, _include_usage(body))
            await send({"type": "http.response.body", "body": tail, "more_body": False})
            return True
        finally:
            watcher.cancel()

    def _metrics(self) -> bytes:
        s, m = self.stats, self.config.model
        labels = f'{{engine="0",model_name="{m}"}}'
        return (
            f"vllm:num_requests_running{labels} {s.running}\n"
            f"vllm:num_requests_waiting{labels} 0\n"
            f"vllm:kv_cache_usage_perc{labels} {min(1.0, s.running / 100)}\n"
            f"vllm:time_to_first_token_seconds_sum{labels} {s.ttft_sum}\n"
            f"vllm:time_to_first_token_seconds_count{labels} {s.ttft_count}\n"
            f"vllm:inter_token_latency_seconds_sum{labels} {s.itl_sum}\n"
            f"vllm:inter_token_latency_seconds_count{labels} {s.itl_count}\n"
            f"vllm:prefix_cache_queries_total{labels} 0\n"
            f"vllm:prefix_cache_hits_total{labels} 0\n"
        ).encode()


class _Chunks:
    """Pre-encoded SSE events; only the token index changes per chunk."""

    def __init__(self, chat: bool, model: str, created: int, token_ids: bool) -> None:
        self.chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": "cmpl-fake", "object": obj, "created": created, "model": model}
        self.head = orjson.dumps(head)[:-1]  # reused prefix, without the closing brace
        self.token_ids = token_ids
        self.role = self._event({"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None},
                                extra=b',"prompt_token_ids":[1,2,3]' if token_ids else b"")

    def _event(self, choice: dict[str, Any], extra: bytes = b"") -> bytes:
        return b"data: " + self.head + b',"choices":[' + orjson.dumps(choice) + b"]" + extra \
            + b"}\n\n"

    def token(self, i: int) -> bytes:
        text = f"tok{i} "
        choice: dict[str, Any] = (
            {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
            if self.chat else
            {"index": 0, "text": text, "logprobs": None, "finish_reason": None})
        if self.token_ids:
            choice["token_ids"] = [100 + i]
        return self._event(choice)

    def finish(self, tokens: int, usage: bool) -> bytes:
        done = ({"index": 0, "delta": {}, "finish_reason": "length"} if self.chat
                else {"index": 0, "text": "", "finish_reason": "length"})
        out = self._event(done)
        if usage:
            out += b"data: " + self.head + b',"choices":[],"usage":' + orjson.dumps(
                {"prompt_tokens": 3, "completion_tokens": tokens,
                 "total_tokens": 3 + tokens}) + b"}\n\n"
        return out + b"data: [DONE]\n\n"


def _full_body(
    chat: bool, model: str, created: int, tokens: int, body: dict[str, Any]
) -> dict[str, Any]:
    text = "".join(f"tok{i} " for i in range(tokens))
    choice: dict[str, Any] = (
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
        if chat else {"index": 0, "text": text, "finish_reason": "length"})
    if body.get("return_token_ids"):
        choice["token_ids"] = [100 + i for i in range(tokens)]
    return {
        "id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion",
        "created": created, "model": model, "choices": [choice],
        "usage": {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens},
    }


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options") or {}
    return bool(isinstance(options, dict) and options.get("include_usage"))


async def _read(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _watch(receive: Receive, gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


@dataclass(frozen=True, slots=True)
class RunningFake:
    app: FakeVllm
    url: str


@contextlib.asynccontextmanager
async def serve_fake(config: FakeConfig, host: str = "127.0.0.1", port: int = 0
                     ) -> AsyncIterator[RunningFake]:
    """Serve a fake in the current event loop until the block ends."""
    app = FakeVllm(config)
    async with uvicorn_in_loop(uvicorn.Config(
            app, host=host, port=port, loop="none", http="httptools", lifespan="on",
            access_log=False, log_config=None, timeout_graceful_shutdown=1)) as url:
        yield RunningFake(app, url)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="fake vLLM OpenAI server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model", default="fake")
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--tpot-ms", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args(argv)
    config = FakeConfig(model=args.model, ttft_s=args.ttft_ms / 1000,
                        tpot_s=args.tpot_ms / 1000, default_tokens=args.tokens)
    uvicorn.run(FakeVllm(config), host=args.host, port=args.port, loop="uvloop",
                http="httptools", access_log=False, log_level="warning")


if __name__ == "__main__":
    main()
