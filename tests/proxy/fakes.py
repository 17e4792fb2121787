"""A proxy in front of in-process fake vLLM servers, for the request-path tests."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from bench.fakes.fake_vllm import FakeConfig, RunningFake, serve_fake
from proxy.config import Settings
from proxy.http.server import RunningProxy, serve_in_loop
from proxy.state.rate_counters import WINDOW_S, RateLimiter, window_of

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
ADMIN_TOKEN = "test-admin-token"  # fleet()'s unless a test sets its own admin section
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@contextlib.asynccontextmanager
async def fleet(*configs: FakeConfig, keys: tuple[str | None, ...] = (),
                labels: tuple[dict[str, str], ...] = (), **sections: Any
                ) -> AsyncIterator[tuple[RunningProxy, list[RunningFake]]]:
    """A proxy in front of one fake per config (backends f0, f1, …; `keys[i]`: f{i}'s
    `api_key`, `labels[i]` its labels); `sections`: the rest of the proxy's settings."""
    async with contextlib.AsyncExitStack() as stack:
        fakes = [await stack.enter_async_context(serve_fake(c)) for c in configs]
        backends = [{"name": f"f{i}", "url": f.url, "model": f.app.config.model}
                    for i, f in enumerate(fakes)]
        for backend, key in zip(backends, keys, strict=False):
            if key is not None:
                backend["api_key"] = key
        for backend, backend_labels in zip(backends, labels, strict=False):
            backend["labels"] = backend_labels  # type: ignore[assignment]
        settings = Settings(
            server={"port": 0, **sections.pop("server", {})},  # type: ignore[arg-type]
            backends=backends + sections.pop("extra_backends", []),  # type: ignore[arg-type]
            policy=sections.pop("policy", {"name": "round_robin"}),  # type: ignore[arg-type]
            admin=sections.pop("admin", {"token": ADMIN_TOKEN}),  # type: ignore[arg-type]
            **sections,
        )
        proxy = await stack.enter_async_context(serve_in_loop(settings))
        yield proxy, fakes


async def post(proxy: RunningProxy, body: Any, path: str = "/v1/chat/completions",
               **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as http:
        content = body if isinstance(body, bytes) else orjson.dumps(body)
        return await http.post(path, content=content, **kw)


def events(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


def charged(limiter: RateLimiter, subject: str) -> float:
    """What `subject` was charged in this minute window and the last: the sliding
    estimate at the window's start, where the last one still counts whole (read now,
    a test that crossed a window boundary would see part of its charges aged out)."""
    return limiter.used(subject, window_of(time.time()) * WINDOW_S)
