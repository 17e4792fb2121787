"""Shared parts of the admin/backends/disclosure security tests: a real `laneway serve`
(bench/harness/proxy_process.py) in front of fake vLLM servers that run in a thread of the test
process, so that a test can read what each one received (its `stats`)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx

from bench.fakes.fake_vllm import FakeConfig, RunningFake, serve_fake

TOKEN = "adm-7f3c-test-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@contextlib.contextmanager
def fakes_in_thread(*configs: FakeConfig) -> Iterator[list[RunningFake]]:
    """One fake vLLM per config, served by an event loop in a thread of its own (a
    proxy in another process reaches them; the test reads their stats)."""
    loop = asyncio.new_event_loop()
    started: list[RunningFake] = []
    ready, stop = threading.Event(), asyncio.Event()
    failure: list[BaseException] = []

    async def serve() -> None:
        try:
            async with contextlib.AsyncExitStack() as stack:
                for config in configs:
                    started.append(await stack.enter_async_context(serve_fake(config)))
                ready.set()
                await stop.wait()
        except BaseException as exc:  # reported to the test's thread
            failure.append(exc)
            ready.set()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    ready.wait(30)
    try:
        if failure:
            raise failure[0]
        yield started
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(15)
        loop.close()


def backends(fakes: list[RunningFake]) -> list[dict[str, Any]]:
    """Config entries f0, f1, … for `fakes`."""
    return [{"name": f"f{i}", "url": f.url, "model": f.app.config.model}
            for i, f in enumerate(fakes)]


def admin(url: str, method: str, path: str, **kw: Any) -> httpx.Response:
    """`method /admin/<path>` with the token unless `headers` says otherwise."""
    kw.setdefault("headers", ADMIN)
    return httpx.request(method, f"{url}/admin/{path}", timeout=10, **kw)


def raw_status(url: str, request: bytes) -> int:
    """The status of `request`, sent as these bytes (what an HTTP client refuses to
    send, e.g. a header value with trailing blanks); the connection is closed after."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(request)
        head = b""
        while b"\r\n" not in head:
            chunk = conn.recv(4096)
            if not chunk:
                break
            head += chunk
    return int(head.split(b" ", 2)[1])
