"""uvicorn's httptools protocol with a deadline on a request's headers.

uvicorn closes a connection idle after a response (`timeout_keep_alive`), but sets no
deadline on a fresh connection that sends nothing or on headers that never finish: a
client that opens connections and trickles header bytes (slowloris) holds each one
for ever. Here a connection must complete each request's headers within
`server.header_timeout_s`, counted from the connection's start for its first request
and from the request's first byte for the next ones; otherwise it gets a 408 (or, if
it sent nothing, is closed). The body's deadline is the application's
(`server.body_timeout_s`, proxy/asgi.py: read_body).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.errors import ProxyError, RequestTimeout, error_response

log = logging.getLogger("laneway")


class _HeaderDeadline(HttpToolsProtocol):
    header_timeout_s = 30.0  # set by `with_header_timeout`
    on_408: Callable[[ProxyError], None] = staticmethod(lambda _: None)  # ditto
    _header_timer: asyncio.TimerHandle | None = None
    _began = False  # bytes of the awaited request came

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._began = True
        if self._header_timer is None:  # (the first request's runs from the connection)
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._began = False
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # The client began its next request while this one's answer (a stream) is
            # still going out: its deadline runs from the end of that answer.
            self._arm()
            return
        if self._began:
            log.info("%s: request headers not complete within %g s (server."
                     "header_timeout_s); answered 408 and closed", self.client,
                     self.header_timeout_s)
            err = RequestTimeout(
                f"The request headers did not arrive within {self.header_timeout_s:g} s.")
            _, headers, body = error_response(err)
            head = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\n" + head + b"\r\n" + body)
            self.on_408(err)
        self.transport.close()


def with_header_timeout(timeout_s: float,
                        on_408: Callable[[ProxyError], None] = lambda _: None
                        ) -> type[HttpToolsProtocol]:
    """uvicorn's `http` protocol class, with `timeout_s` to complete a request's headers;
    `on_408` is called for each 408 it sends (to count it)."""
    return type("HttpToolsWithHeaderDeadline", (_HeaderDeadline,),
                {"header_timeout_s": timeout_s, "on_408": staticmethod(on_408)})
