"""GET every backend's `/metrics` over one kept-alive HTTP/1.1 connection each.

The poller does one small GET per backend per interval: 5,120 a second at 512
backends. Through aiohttp a GET cost ~200 µs of CPU here (request and response
objects, header multidicts, a timeout per request); a bare asyncio protocol with a
request built once and httptools' C parser costs ~50 µs (`make bench-scale`).

The request also names the samples the poller reads: `GET /metrics/?name[]=...`.
vLLM mounts prometheus_client's ASGI app at `/metrics/`, which honours the filter
(vLLM's ~50 KB page shrinks to ~2 KB: less to render, send and parse); plain
`/metrics` is the instrumentator's route, which ignores it. A server that answers the
filtered path with anything but 200 is asked for plain `/metrics` from then on, in the
same scrape; one that ignores the filter sends everything, which the parser reads the
same way.

One request at a time per backend (the poller never overlaps its own scrapes); any
error, timeout or unexpected byte closes the connection and the next scrape opens a
new one.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Iterable
from typing import cast
from urllib.parse import quote, urlsplit

import httptools

__all__ = ["Scraper"]

log = logging.getLogger("laneway.poller")


class _Connection(asyncio.Protocol):
    """A keep-alive connection answering one GET at a time with (status, body), or
    None on a broken connection or a timeout."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._body: list[bytes] = []
        self._answer: asyncio.Future[tuple[int, bytes] | None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    @property
    def idle(self) -> bool:
        return self.transport is not None and self._answer is None

    def get(self, request: bytes, timeout_s: float) -> asyncio.Future[tuple[int, bytes] | None]:
        assert self.transport is not None and self._answer is None
        loop = asyncio.get_running_loop()
        self._answer = answer = loop.create_future()
        self._timer = loop.call_later(timeout_s, self._give_up)
        self.transport.write(request)
        return answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._give_up()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._finish(None)

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        status = self._parser.get_status_code()
        body, self._body = b"".join(self._body), []
        if not self._parser.should_keep_alive():
            self.close()
        self._finish((status, body))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def _give_up(self) -> None:
        self.close()  # a late answer must not be read as the next request's
        self._finish(None)

    def _finish(self, answer: tuple[int, bytes] | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        future, self._answer = self._answer, None
        if future is not None and not future.done():
            future.set_result(answer)


class Scraper:
    """`get(url)`: the body of a 200 answer from `url`'s metrics page, or None."""

    def __init__(self, timeout_s: float, names: Iterable[str] = ()) -> None:
        self._timeout_s = timeout_s
        query = "&".join(f"name%5B%5D={quote(name, safe='')}" for name in names)
        self._filtered_path = f"/metrics/?{query}" if query else ""
        self._connections: dict[str, _Connection] = {}
        self._requests: dict[str, tuple[bytes, ...]] = {}  # filtered (if any), plain
        self._tls: ssl.SSLContext | None = None

    def get(self, url: str) -> asyncio.Future[bytes | None]:
        """A future of the body; no task when a connection is open (the hot path)."""
        connection = self._connections.get(url)
        if connection is None or not connection.idle:
            if connection is not None:
                connection.close()  # still busy: a scrape overran; start clean
            return asyncio.ensure_future(self._connect_and_get(url))
        body: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
        self._ask(url, connection, body)
        return body

    async def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()
        await asyncio.sleep(0)  # let the transports finish closing

    def forget(self, keep: Iterable[str]) -> None:
        """Close the connections of backends no longer configured."""
        kept = set(keep)
        for url in [u for u in self._connections if u not in kept]:
            self._connections.pop(url).close()
            self._requests.pop(url, None)

    def _ask(self, url: str, connection: _Connection, body: asyncio.Future[bytes | None]
             ) -> None:
        requests = self._requests[url]
        answer = connection.get(requests[0], self._timeout_s)
        answer.add_done_callback(lambda done: self._answered(url, connection, body, done))

    def _answered(self, url: str, connection: _Connection, body: asyncio.Future[bytes | None],
                  answer: asyncio.Future[tuple[int, bytes] | None]) -> None:
        result = answer.result()
        if body.done():
            return
        if result is not None and result[0] == 200:
            body.set_result(result[1])
        elif result is not None and len(self._requests[url]) > 1:
            log.info("%s: no filtered metrics page (HTTP %d); reading /metrics", url, result[0])
            self._requests[url] = self._requests[url][1:]
            if connection.idle:
                self._ask(url, connection, body)
            else:
                body.set_result(None)
        else:
            body.set_result(None)

    async def _connect_and_get(self, url: str) -> bytes | None:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        if tls and self._tls is None:
            self._tls = ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._timeout_s):
                _, connection = await loop.create_connection(
                    _Connection, parts.hostname or "localhost", parts.port or (443 if tls else 80),
                    ssl=self._tls if tls else None)
        except (OSError, TimeoutError):
            return None
        self._connections[url] = connection
        if url not in self._requests:
            self._requests[url] = self._build_requests(parts.path.rstrip("/"),
                                                       parts.netloc.rsplit("@", 1)[-1])
        body: asyncio.Future[bytes | None] = loop.create_future()
        self._ask(url, connection, body)
        try:
            return await body
        except asyncio.CancelledError:
            connection.close()
            raise

    def _build_requests(self, prefix: str, host: str) -> tuple[bytes, ...]:
        paths = ([f"{prefix}{self._filtered_path}"] if self._filtered_path else []) \
            + [f"{prefix}/metrics"]
        return tuple(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAccept: text/plain\r\n\r\n"
                     .encode() for path in paths)
