"""The upstream side of the relay: open a request on a backend and read its body.

aiohttp is the client on the hot path: measured here it costs ~15 CPU µs per relayed
token against ~200-500 µs for httpx's own transport (see README, Benchmarks). One
pooled session lives for the whole process; nothing is allocated per request but the
request itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from proxy.asgi import Send
from proxy.config import UpstreamConfig
from proxy.errors import (
    NoHealthyBackend,
    ProxyError,
    UpstreamError,
    UpstreamTimeout,
    mid_stream_failure,
)
from proxy.observability.tracing import Span, Tracing, answered
from proxy.relay.stream_accounting import StreamTally
from proxy.request_context import plain_request_id
from proxy.types import Backend

log = logging.getLogger("laneway.relay")

# Headers that describe one hop, not the message (RFC 9110 §7.6.1), plus the ones
# aiohttp sets itself. accept-encoding too: the upstream leg stays uncompressed so
# the relay can pass stream bytes through (and scan them) without re-encoding.
_HOP_HEADERS = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
     "upgrade", "proxy-authorization", "proxy-authenticate", "trailer", "expect",
     "accept-encoding"}
)
_CREDENTIALS = frozenset({"authorization", "x-api-key"})
# What a client must not tell a backend: where the request came from (the backend
# would believe a forged address), a scheduling priority of its own choosing, and the
# data-parallel engine of a vLLM with several (vLLM honours `X-data-parallel-rank`:
# a client could pile its requests, and others', onto one rank).
_CLIENT_CLAIMS = frozenset({"forwarded", "x-real-ip", "x-vllm-priority",
                            "x-data-parallel-rank"})
_CLIENT_CLAIM_PREFIX = "x-forwarded-"
_ERROR_BODY_LIMIT = 64 * 1024
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")  # how an SSE event ends (vLLM: the first)
# Whole JSON answers up to this size are parsed to check they are complete; larger ones
# (embeddings of many inputs) only by their first and last bytes.
_PARSED_ANSWER_LIMIT = 256 * 1024
# Fresh tries on the same backend after a pooled connection turned out closed. Several
# can be stale at once: a proxy that fell behind returns a stream's connection to its
# pool only when it has read the stream, seconds after the backend sent its end and
# started its own keep-alive clock; each failed try drops one.
STALE_RETRIES = 4


def stale_connection(exc: BaseException) -> bool:
    """Whether `exc` is a kept-alive connection the backend had closed, found while
    sending the request: nothing reached vLLM, so the same backend may be tried again.
    (A refused connection is not: that backend is down.)"""
    return isinstance(exc, aiohttp.ServerDisconnectedError) or (
        isinstance(exc, aiohttp.ClientOSError)
        and not isinstance(exc, aiohttp.ClientConnectorError))


class UpstreamFailure(Exception):
    """A backend could not give a usable response; the request may go elsewhere."""

    def __init__(self, backend: Backend, kind: str, detail: str, *, status: int | None = None):
        super().__init__(f"{backend.name}: {kind}: {detail}")
        self.backend = backend
        self.kind = kind  # connect | timeout | status | broken
        self.detail = detail
        self.status = status

    @property
    def unreachable(self) -> bool:
        """Whether the backend itself looks down (not just this request failing)."""
        return self.kind in ("connect", "timeout")


@dataclass(slots=True)
class Opened:
    """A backend answered. `head` is the first body bytes (whole body if `complete`)."""

    backend: Backend
    response: aiohttp.ClientResponse
    head: bytes
    complete: bool
    span: Span | None = None  # its request's span, while tracing (proxy/observability/tracing.py)

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def content_type(self) -> bytes:
        return self.response.headers.get("content-type", "application/json").encode()

    def answer_headers(self, request_id: str) -> list[tuple[bytes, bytes]]:
        """The headers of the client's answer relaying this one: its content type (and
        length, for a whole answer), which backend answered, and the request's id."""
        headers = [(b"content-type", self.content_type),
                   (b"x-laneway-backend", self.backend.name.encode()),
                   (b"x-request-id", request_id.encode())]
        if self.complete:
            headers.append((b"content-length", str(len(self.head)).encode()))
        return headers

    async def next_chunk(self) -> bytes:
        """The next body bytes as they arrive; b"" at the end of the body."""
        if self.complete:
            return b""
        return await self.response.content.readany()

    def close(self) -> None:
        # close(), not release(): an unfinished response must drop the connection so
        # that vLLM sees the disconnect and aborts the request.
        self.response.close()
        if self.span is not None:
            self.span.end()
            self.span = None

    def fail(self, kind: str, detail: str) -> None:
        """The answer failed on the way (its span, if traced, says how)."""
        if self.span is not None:
            self.span.fail(kind, detail)


def forward_headers(raw: list[tuple[bytes, bytes]], credentials: bool = True
                    ) -> dict[str, str]:
    """The client's headers a backend gets: not the hop-by-hop ones (those named in its
    `Connection` header too), not its claims of origin or priority (`X-Forwarded-*`,
    `Forwarded`, `X-Vllm-Priority`), not an `x-request-id` too long or odd to echo, and
    not the client's credentials without
    `credentials` (laneway checked them: its keys are not the backends'). A backend
    with an `api_key` gets that instead (`Upstream._send`)."""
    dropped = _HOP_HEADERS | _CLIENT_CLAIMS | (frozenset() if credentials else _CREDENTIALS)
    named = {token.strip().lower() for k, v in raw if k.lower() == b"connection"
             for token in v.decode("latin-1").split(",")}
    headers = {}
    for k, v in raw:
        name = k.decode("latin-1").lower()
        if name not in dropped and name not in named \
                and not name.startswith(_CLIENT_CLAIM_PREFIX) \
                and (name != "x-request-id" or plain_request_id(v.decode("latin-1"))):
            headers[k.decode("latin-1")] = v.decode("latin-1")
    return headers


def backend_auth(api_key: str, headers: Mapping[str, str]) -> dict[str, str]:
    """`headers` with the backend's key as their only credentials."""
    kept = {k: v for k, v in headers.items() if k.lower() not in _CREDENTIALS}
    return kept | {"Authorization": f"Bearer {api_key}"}


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, cfg: UpstreamConfig,
                 sent: Callable[[str], None] = lambda backend: None,
                 tracing: Tracing | None = None) -> None:
        """`sent(backend name)` runs for every request sent (passive health counts them);
        with `tracing`, each request made for a traced one is a span
        (proxy/observability/tracing.py)."""
        self._session = session
        self._cfg = cfg
        self._sent = sent
        self._tracing = tracing
        # Until the first byte, allow a long wait (queueing, prefill, or a whole
        # non-streamed generation); after it, only `read_timeout_s` between chunks.
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.first_byte_timeout_s
        )

    async def open(
        self, backend: Backend, path: str, body: bytes | None, headers: dict[str, str],
        stream: bool, method: str = "POST",
    ) -> Opened:
        """Send the request; return once its first body bytes are here (or raise)."""
        with self._attempt(backend, method, path, headers) as (span, headers):
            try:
                response = await self._send_fresh(method, backend, path, body, headers)
            except aiohttp.ClientConnectorError as exc:
                raise UpstreamFailure(backend, "connect", str(exc)) from None
            except TimeoutError:
                raise UpstreamFailure(backend, "timeout", "no response headers in time"
                                      ) from None
            except aiohttp.ClientError as exc:
                raise UpstreamFailure(backend, "broken", repr(exc)) from None
            try:
                opened = await self._first_bytes(backend, response, stream)
            except BaseException:
                response.close()
                raise
        if span is not None:  # it ends when the answer is closed
            answered(span, opened.status)
            opened.span = span
        return opened

    async def call_json(
        self, backend: Backend, path: str, body: bytes, headers: dict[str, str],
        timeout_s: float | None = None,
    ) -> Any:
        """A small JSON request/response (e.g. vLLM's `/tokenize`); raises UpstreamFailure."""
        status, payload, _ = await self.whole("POST", backend, path, body, headers, timeout_s)
        if status != 200:
            raise UpstreamFailure(backend, "status", f"{path}: HTTP {status}: "
                                  f"{payload[:300].decode(errors='replace')}", status=status)
        try:
            return orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise UpstreamFailure(backend, "broken", f"{path}: not JSON") from None

    async def whole(self, method: str, backend: Backend, path: str, body: bytes | None,
                    headers: dict[str, str], timeout_s: float | None = None
                    ) -> tuple[int, bytes, bytes]:
        """(status, body, content type) of a small request answered at once; raises
        UpstreamFailure when no answer came (in `timeout_s`, default the first-byte one)."""
        with self._attempt(backend, method, path, headers) as (span, headers):
            try:
                async with asyncio.timeout(timeout_s or self._cfg.first_byte_timeout_s):
                    response = await self._send_fresh(method, backend, path, body, headers)
                    async with response:
                        payload = await response.read()
            except aiohttp.ClientConnectorError as exc:
                raise UpstreamFailure(backend, "connect", str(exc)) from None
            except TimeoutError:
                raise UpstreamFailure(backend, "timeout", f"{path} did not answer") from None
            except aiohttp.ClientError as exc:
                raise UpstreamFailure(backend, "broken", repr(exc)) from None
        if span is not None:
            answered(span, response.status)
            span.end()
        content_type = response.headers.get("content-type", "application/json").encode()
        return response.status, payload, content_type

    def _attempt(self, backend: Backend, method: str, path: str, headers: dict[str, str]
                 ) -> AbstractContextManager[tuple[Span | None, dict[str, str]]]:
        """(its span or None, the headers to send) of a request to `backend`."""
        if self._tracing is None:
            return contextlib.nullcontext((None, headers))
        return self._tracing.attempt(backend, method, path, headers)

    async def _send_fresh(
        self, method: str, backend: Backend, path: str, body: bytes | None,
        headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        """`_send`, tried again (at most `STALE_RETRIES` times) while the pooled
        connection it took turns out closed by the backend."""
        for retries in range(STALE_RETRIES + 1):
            try:
                return await self._send(method, backend, path, body, headers)
            except aiohttp.ClientError as exc:
                if retries == STALE_RETRIES or not stale_connection(exc):
                    raise
                log.debug("%s %s on %s: stale pooled connection (%r); trying again",
                          method, path, backend.name, exc)
        raise AssertionError("unreachable")

    async def _send(
        self, method: str, backend: Backend, path: str, body: bytes | None,
        headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        if backend.api_key is not None:
            headers = backend_auth(backend.api_key, headers)
        self._sent(backend.name)
        # A redirect is not followed: it would send the prompt (and, on the same origin,
        # the backend's key) to a host neither the config nor admin.backend_allowlist
        # names, and relay that host's answer to the client (docs/security.md).
        return await self._session.request(
            method, backend.url + path, data=body, headers=headers, timeout=self._timeout,
            allow_redirects=False)

    async def _first_bytes(
        self, backend: Backend, response: aiohttp.ClientResponse, stream: bool
    ) -> Opened:
        try:
            if response.status >= 500:
                detail = (await response.content.read(_ERROR_BODY_LIMIT)).decode(errors="replace")
                raise UpstreamFailure(backend, "status", f"HTTP {response.status}: {detail[:500]}",
                                      status=response.status)
            if not stream or response.status != 200:
                payload = await _read_body(response, self._cfg.read_timeout_s)
                if response.status == 200 and not _complete_json(response, payload):
                    raise UpstreamFailure(backend, "broken", "incomplete JSON answer: "
                                          f"{payload[-100:].decode(errors='replace')!r}")
                return Opened(backend, response, payload, complete=True)
            # bounded here too: aiohttp's `sock_read` does not fire when its C parser
            # stops on a chunk size that is not hex (`_read_body`), and the first read of
            # a stream would then wait for ever (found by the real-vLLM backend fuzz)
            async with asyncio.timeout(self._cfg.first_byte_timeout_s):
                head = await response.content.readany()
        except TimeoutError:
            raise UpstreamFailure(backend, "timeout", "no first byte in time") from None
        except aiohttp.ClientError as exc:
            raise UpstreamFailure(backend, "broken", repr(exc)) from None
        if not head:
            raise UpstreamFailure(backend, "broken", "stream closed before its first byte")
        protocol = response.connection.protocol if response.connection else None
        if protocol is not None:
            # From here `StallWatch` bounds the silence between chunks: aiohttp's own
            # read timeout re-arms a timer on every token, the watch once a period.
            protocol.read_timeout = None
            protocol.start_timeout()
        return Opened(backend, response, head, complete=False)


def _complete_json(response: aiohttp.ClientResponse, payload: bytes) -> bool:
    """Whether a whole 200 answer that says it is JSON is one: a body cut short (a
    backend that closed a body without a length early, or lied about its length) is a
    failure to retry, not an answer to relay."""
    if not response.headers.get("content-type", "").startswith("application/json"):
        return True
    if len(payload) > _PARSED_ANSWER_LIMIT:
        body = payload.strip()
        return body[:1] + body[-1:] in (b"{}", b"[]")
    try:
        orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False
    return True


async def _read_body(response: aiohttp.ClientResponse, read_timeout_s: float) -> bytes:
    """A whole answer's body, failed (TimeoutError) once the backend has sent nothing of
    it for `read_timeout_s`: aiohttp's own `sock_read` does not fire when its C parser
    stops on a chunk size that is not hex (aiohttp 3.14.5; the pure-Python parser
    raises), and such a read would wait for ever."""
    if response.content.is_eof():  # the usual whole answer: here with its headers
        return await response.read()
    parts: list[bytes] = []
    last_at = [time.monotonic()]
    watch = StallWatch(response.close, read_timeout_s, lambda: last_at[0])
    try:
        async for part in response.content.iter_any():
            parts.append(part)
            last_at[0] = time.monotonic()
    except aiohttp.ClientError:
        if watch.fired:
            raise TimeoutError from None
        raise
    finally:
        watch.cancel()
    if watch.fired:
        raise TimeoutError
    return b"".join(parts)


class StallWatch:
    """Close (`close`) a response whose backend has sent nothing for `timeout_s`.

    `last_at` reports the monotonic time of the latest chunk. The check runs once per
    `timeout_s` at most, so a healthy stream costs one timer per period, not per token.
    """

    def __init__(self, close: Callable[[], None], timeout_s: float,
                 last_at: Callable[[], float]):
        self.fired = False
        self._close, self._timeout_s, self._last_at = close, timeout_s, last_at
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(timeout_s, self._check)

    def _check(self) -> None:
        idle = time.monotonic() - self._last_at()
        if idle >= self._timeout_s:
            self.fired = True
            self._close()  # the pending read fails; the relay reports a timeout
        else:
            self._handle = self._loop.call_later(self._timeout_s - idle, self._check)

    def cancel(self) -> None:
        self._handle.cancel()


async def relay_answer(opened: Opened, send: Send, request_id: str, tally: StreamTally,
                       read_timeout_s: float, failed: Callable[[str, str], None],
                       finishing: Callable[[], None] | None = None) -> None:
    """The backend's answer to the client, whole or as it streams (counted in `tally`),
    then closed. A silence longer than `read_timeout_s`, a broken stream, or one that
    ends without its end event (`[DONE]`, or `tally`'s `StreamEnd`) ends with an error
    event; `tally.failed` is set and `failed(backend, kind)` counts it. `finishing` runs
    just before the last send (from then on the client's leaving changes nothing)."""
    try:
        await send({"type": "http.response.start", "status": opened.status,
                    "headers": opened.answer_headers(request_id)})
        if not opened.complete:
            await _relay_stream(opened, send, tally, read_timeout_s, failed)
        if finishing is not None:
            finishing()
        await send({"type": "http.response.body",
                    "body": opened.head if opened.complete else b"", "more_body": False})
    finally:
        opened.close()


async def _relay_stream(opened: Opened, send: Send, tally: StreamTally, read_timeout_s: float,
                        failed: Callable[[str, str], None]) -> None:
    """Relay the stream's bytes as they come, but only up to the last whole event: the
    client never gets half an event (its JSON cut off by a failure) before the error
    event. `tally` counts what went out, so the end event it looks for is a whole one."""
    watch = StallWatch(opened.close, read_timeout_s, tally.last_seen)
    chunk, torn = opened.head, b""  # torn: the unfinished event at the end of what came
    try:
        while chunk:
            if torn:
                chunk, torn = torn + chunk, b""
            if not chunk.endswith(_EVENT_ENDS):
                end = _whole_events(chunk)
                chunk, torn = chunk[:end], chunk[end:]
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                tally.add(chunk, time.monotonic())
            chunk = await opened.next_chunk()
            if chunk:  # (a chunk of half an event is still the backend alive)
                tally.last_at = time.monotonic()
        await _end_unended(torn, send, tally)
        if not tally.saw_done:
            raise aiohttp.ClientPayloadError("stream ended inside an event" if torn
                                             else "stream ended without its end event")
    except (aiohttp.ClientError, TimeoutError) as exc:
        kind = "timeout" if watch.fired or isinstance(exc, TimeoutError) else "broken"
        await _end_unended(torn, send, tally)
        if tally.saw_done:  # after its end event: the client has the whole answer
            log.info("%s: the stream's body failed after its end event (%s: %r); the "
                     "answer is whole", opened.backend.name, kind, exc)
            return
        tally.failed = True
        failed(opened.backend.name, kind)
        opened.fail(kind, repr(exc))
        log.warning("%s: the stream failed (%s): %r", opened.backend.name, kind, exc)
        err = mid_stream_failure(opened.backend.name, kind)
        await send({"type": "http.response.body", "body": tally.error_event(err),
                    "more_body": True})
    finally:
        watch.cancel()


async def _end_unended(torn: bytes, send: Send, tally: StreamTally) -> None:
    """The stream's last event without its blank line (`[DONE]`, or the Responses or
    Messages API's terminal event, its JSON whole; the body ended, or broke, right
    after it): the stream's end, sent whole."""
    if torn and not tally.saw_done and tally.is_end_event(torn):
        event = torn.rstrip(b"\r\n") + b"\n\n"
        await send({"type": "http.response.body", "body": event, "more_body": True})
        tally.add(event, time.monotonic())


def _whole_events(chunk: bytes) -> int:
    """How many bytes of `chunk` are whole events (up to its last event end)."""
    lf, crlf = chunk.rfind(b"\n\n"), chunk.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def exhausted(model: str, failures: list[UpstreamFailure], retry_after_s: int) -> ProxyError:
    """The client's error once no attempt on `model`'s backends gave a response."""
    if not failures:
        return NoHealthyBackend(
            f"No healthy backend serves model `{model}` right now.",
            retry_after_s=retry_after_s)
    if all(f.kind == "connect" for f in failures):  # e.g. panic mode over dead backends
        tried = ", ".join(f.backend.name for f in failures)
        return NoHealthyBackend(
            f"No backend serving model `{model}` accepts connections right now "
            f"(tried {tried}).", retry_after_s=retry_after_s)
    # Each failure's detail (a backend's answer, an address) is in the log
    # (Runtime.upstream_failed), not in what the client reads.
    tried = ", ".join(f"{f.backend.name}: " + (f"HTTP {f.status}" if f.status else f.kind)
                      for f in failures)
    if all(f.kind == "timeout" for f in failures):
        return UpstreamTimeout(f"Every backend tried timed out ({tried}).")
    return UpstreamError(f"Every backend tried failed ({tried}).")
