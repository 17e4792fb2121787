"""Small ASGI helpers: read a bounded body, send JSON or an error."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping, Sequence
from typing import Any

import orjson

from proxy.errors import PayloadTooLarge, ProxyError, RequestTimeout, error_response

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected before its request was read."""


def header_map(scope: Scope) -> dict[str, str]:
    """Request headers by lower-case name (ASGI already lower-cases them)."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


async def read_body(headers: dict[str, str], receive: Receive, limit: int,
                    timeout_s: float = 60.0) -> bytes:
    """The whole body, at most `limit` bytes, arrived within `timeout_s` (a client that
    trickles it, or stops sending, does not hold the request open)."""
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"Request body of {declared} bytes exceeds the {limit}-byte limit.")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk: bytes = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"Request body exceeds the {limit}-byte limit.")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        raise RequestTimeout(f"The request body did not arrive within {timeout_s:g} s "
                             f"({size} bytes came); send it faster.") from None


async def send_bytes(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def with_headers(send: Send, headers: Sequence[tuple[bytes, bytes]]) -> Send:
    """`send` that adds `headers` to the response's start."""
    async def adding(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), *headers]
        await send(message)
    return adding


async def send_json(
    send: Send, status: int, payload: Any, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = orjson.dumps(payload)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send_bytes(send, status, body, headers + (extra or []))


async def send_error(send: Send, err: ProxyError, anthropic: bool = False) -> None:
    status, headers, body = error_response(err, anthropic)
    await send_bytes(send, status, body, headers)


async def until_disconnect(receive: Receive, work: Coroutine[Any, Any, None],
                           on_gone: Callable[[], None]) -> None:
    """Run `work` (which answers the request); if the client disconnects first, call
    `on_gone` and cancel it, so the backend's work stops too."""
    task = asyncio.create_task(work)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            on_gone()
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        watcher.cancel()
        task.cancel()
