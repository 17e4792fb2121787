"""uvicorn's httptools protocol with bounds on what one client connection may hold.

uvicorn alone bounds neither a request's headers (their size, their count) nor the
time a client takes to send them or its body, and its keep-alive timer restarts on
every byte, so a client trickling bytes (slowloris), or one that never reads its
answer, holds a connection, and what the request holds, for ever. Here, per connection
(docs/security_limits.md):

* the request line and headers are at most `max_header_bytes` (counted as they are
  read, so an endless header is cut before it is buffered) and `max_header_count`
  lines: otherwise 431;
* a request's headers arrive within `header_timeout_s` (from the connection's start
  for its first request, from the request's first byte for the next ones), and the
  whole request, body included, within `request_timeout_s` of its first byte:
  otherwise 408 (or, with nothing sent, the connection is closed);
* between requests a connection idles at most `keep_alive_s`; bytes that begin no
  request (blank lines) do not extend it;
* an answer the client does not drain within `write_timeout_s` (the transport stays
  paused that long) aborts the connection, so the request ends and releases what it
  held (its in-flight count, flow-control slot, backend request).

And across the process's connections: the bodies of the requests in progress (their
`content-length`, `max_body_bytes` for a chunked one) add up to at most
`max_body_bytes_in_flight`; a request past it gets 503 before its body is read, so no
number of clients makes the proxy hold (and parse) more than that.

The timers hang on the transport's own callbacks (data, parser events, pause and
resume of writing): nothing runs per relayed chunk. uvicorn's own 400 (a malformed
request) is answered in OpenAI's error shape too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from proxy.errors import (
    HeadersTooLarge,
    InvalidRequest,
    Overloaded,
    ProxyError,
    RequestTimeout,
    error_response,
)

log = logging.getLogger("laneway")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The `server.*` bounds a connection is held to (see the module's docstring)."""

    header_timeout_s: float = 30.0
    request_timeout_s: float = 90.0
    keep_alive_s: float = 75.0
    write_timeout_s: float = 60.0
    max_header_bytes: int = 64 * 1024
    max_header_count: int = 100
    max_body_bytes: int = 4 * 1024 * 1024
    max_body_bytes_in_flight: int = 64 * 1024 * 1024


class BodyBudget:
    """The body bytes the process's requests in progress hold (one per server)."""

    def __init__(self) -> None:
        self.held = 0


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a request the proxy refuses."""


class _Guarded(HttpToolsProtocol):
    limits = ConnectionLimits()  # set by `guarded_protocol`
    budget = BodyBudget()  # ditto
    _body_held = 0  # what this connection's request holds of `budget`
    on_refused: Callable[[ProxyError], None] = staticmethod(lambda _: None)  # ditto
    _read_timer: asyncio.TimerHandle | None = None  # idle, headers or body deadline
    _write_timer: asyncio.TimerHandle | None = None
    _began = False  # bytes of the awaited request came (its headers are being read)
    _began_at = 0.0
    _in_body = False  # its headers came, its body is being read
    _head_bytes = 0  # bytes read while awaiting or reading the headers
    _header_count = 0
    _header_bytes = 0  # the request's header lines, as parsed
    _refusal: ProxyError | None = None  # the answer once the request is refused
    _idle = False  # the read timer is the keep-alive one (between requests)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, self._head_expired)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return
        if not self._in_body:  # (a chunk that starts in a body is that body's)
            self._head_bytes += len(data)  # (reset once the headers are complete)
        super().data_received(data)  # (parser errors, _Refused too: send_400_response)
        if self._refusal is None and not self._in_body \
                and self._head_bytes > self.limits.max_header_bytes:
            self._refuse(self._too_large())

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._began, self._began_at, self._header_count = True, self.loop.time(), 0
        self._header_bytes = 0
        if self._read_timer is None or self._idle:
            self._arm(self.limits.header_timeout_s, self._head_expired)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_header_bytes:
            self._refusal = self._too_large()
            raise _Refused

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._header_bytes += len(name) + len(value) + 4  # "name: value\r\n"
        if len(self.url) + self._header_bytes > self.limits.max_header_bytes:
            self._refusal = self._too_large()  # (all of it in one read: no chunk count)
            raise _Refused
        if self._header_count > self.limits.max_header_count:
            self._refusal = HeadersTooLarge(
                f"The request has more than {self.limits.max_header_count} header lines "
                "(server.max_header_count).")
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._hold_body()
        self._began, self._in_body, self._head_bytes = False, True, 0
        left = self.limits.request_timeout_s - (self.loop.time() - self._began_at)
        self._arm(max(left, 0.0), self._body_expired)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        self._disarm()
        super().on_message_complete()
        self._await_next()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._release_body()
        self._await_next()

    def _await_next(self) -> None:
        """Once the request was read whole and answered, the connection idles for the
        next one at most `keep_alive_s` (uvicorn's own timer restarts on every byte)."""
        answered = self.cycle is None or self.cycle.response_complete
        if answered and not self._began and not self._in_body \
                and not self.transport.is_closing():
            self._arm(self.limits.keep_alive_s, self._idle_expired)
            self._idle = True

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s,
                                                     self._write_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._release_body()
        self._disarm()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it cannot parse (or one refused in a parser
        callback), in OpenAI's error shape."""
        err = self._refusal or InvalidRequest(f"{msg} (malformed HTTP/1.1)")
        self._refusal = None
        self._refuse(err)

    def _hold_body(self) -> None:
        """Count the request's body against the process's budget, or refuse it (503)."""
        self._release_body()  # (a pipelined request after one answered early)
        size = 0
        for name, value in self.headers:
            if name == b"content-length" and value.isdigit():
                size = int(value)
            elif name == b"transfer-encoding":
                size = self.limits.max_body_bytes  # chunked: as large as allowed
        if not size:
            return
        if self.budget.held + size > self.limits.max_body_bytes_in_flight:
            log.warning("%s: request bodies in progress would exceed %d bytes "
                        "(server.max_body_bytes_in_flight); answered 503", self.client,
                        self.limits.max_body_bytes_in_flight)
            self._refusal = Overloaded(
                "The proxy holds as many request bodies as it may "
                "(server.max_body_bytes_in_flight); retry shortly.", retry_after_s=1)
            raise _Refused
        self.budget.held += size
        self._body_held = size

    def _release_body(self) -> None:
        self.budget.held -= self._body_held
        self._body_held = 0

    def _arm(self, delay_s: float, expired: Callable[[], None]) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(delay_s, expired)

    def _disarm(self) -> None:
        self._idle = False
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _too_large(self) -> HeadersTooLarge:
        return HeadersTooLarge(f"The request line and headers exceed "
                               f"{self.limits.max_header_bytes} bytes "
                               "(server.max_header_bytes).")

    def _head_expired(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # The client began its next request while this one's answer (a stream) is
            # still going out: its deadline runs from the end of that answer.
            self._arm(self.limits.header_timeout_s, self._head_expired)
            return
        if not self._began:  # it sent nothing: no answer is owed
            self.transport.close()
            return
        log.info("%s: request headers not complete within %g s (server.header_timeout_s);"
                 " answered 408 and closed", self.client, self.limits.header_timeout_s)
        self._refuse(RequestTimeout(
            f"The request headers did not arrive within {self.limits.header_timeout_s:g} s."))

    def _body_expired(self) -> None:
        """The request's body did not arrive whole within `request_timeout_s` of its
        first byte, whatever the application did with it (an answer may have gone out
        before its body was read)."""
        self._read_timer = None
        if self.transport.is_closing():
            return
        log.info("%s: request not complete within %g s (server.request_timeout_s); "
                 "closed", self.client, self.limits.request_timeout_s)
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            self._refuse(RequestTimeout(f"The request did not arrive whole within "
                                        f"{self.limits.request_timeout_s:g} s."))
            return
        self.transport.close()

    def _idle_expired(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def _write_expired(self) -> None:
        """The client read none of its answer for `write_timeout_s`: drop the connection
        (abort: its unsent bytes are discarded), which ends the request like a
        disconnect."""
        self._write_timer = None
        if self.transport.is_closing():
            return
        log.info("%s: the client read nothing of its answer for %g s "
                 "(server.write_timeout_s); connection dropped", self.client,
                 self.limits.write_timeout_s)
        self.transport.abort()

    def _refuse(self, err: ProxyError) -> None:
        """Answer `err` (the request is not handed to the application, or it stops
        waiting for its body) and close the connection."""
        self._refusal = err
        self._disarm()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # The application, if it still reads this request, sees it end as a
            # disconnect, and whatever it would send now is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started:  # no room for another answer in this one
                self.transport.close()
                return
        status, headers, body = error_response(err)
        head = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
        closing = b"" if any(name == b"connection" for name, _ in headers) \
            else b"connection: close\r\n"
        self.transport.write(STATUS_LINE[status] + head + closing + b"\r\n" + body)
        self.on_refused(err)
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits,
                     on_refused: Callable[[ProxyError], None] = lambda _: None
                     ) -> type[HttpToolsProtocol]:
    """uvicorn's `http` protocol class, holding each connection to `limits`;
    `on_refused` is called for each error it answers itself (to count it)."""
    return type("GuardedHttpTools", (_Guarded,),
                {"limits": limits, "on_refused": staticmethod(on_refused),
                 "budget": BodyBudget()})
