"""Distributed tracing (`tracing:`): spans exported over OTLP/HTTP, W3C trace context.

With `tracing.otlp_endpoint` set, every `/v1/...` request is a SERVER span, a child of
the client's `traceparent` when it sent one. Each request the proxy sends a backend for
it (the generation, a retry elsewhere, a migration's continuation, `/tokenize`) is a
CLIENT span under it, and its `traceparent` goes to the backend: vLLM started with
`--otlp-traces-endpoint` puts its own `llm_request` span (queue time, prefill, decode,
tokens) under that. One trace then shows the client's call, the proxy's routing, every
backend it tried and what the engine did.

What the request span carries: the access log's fields (`laneway.model`,
`laneway.policy`, `laneway.backend`, tokens, migrations, ...; proxy/observability/access_log.py),
the
HTTP status, and as span events the proxy's own log lines about the request (why it
was retried, moved, shed). Its status is an error for a 5xx answer and for a stream
that ended with an error event. The trace id is in the access log line (`trace_id`).

Why not OpenTelemetry's SDK: measured here, its spans cost ~45 µs each to make and
~65 µs each to encode (protobuf from Python, in an export thread that takes the GIL
from the event loop). These spans are small slotted objects, encoded as OTLP/JSON with
orjson when they end and sent from the event loop with aiohttp: ~27 µs per traced chat
request for both of its spans (README, Benchmarks, Tracing). The wire format is
OTLP's own (the tests decode it with OpenTelemetry's protobuf definitions), which every
collector takes (the OpenTelemetry Collector, Jaeger, Tempo, vendors' endpoints).

Spans wait in a bounded buffer and leave in batches; when the collector is slow or down
they are dropped (counted in `laneway_trace_spans_dropped_total`), never the requests.
Off (the default): no span, no cost, and the client's `traceparent` is forwarded as it
came.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import time
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from proxy.asgi import Message, Receive, Scope, Send, header_map
from proxy.config import TracingConfig
from proxy.observability.access_log import NOTES, Http, note
from proxy.tasks import stop_task
from proxy.types import Backend

log = logging.getLogger("laneway")
# The logger whose records become the request span's events (not the access log's:
# its line is written once the span has ended and is no longer current).
_EVENTS_FROM = "laneway"
# Access log fields that have a standard attribute name (semantic conventions).
_STANDARD = {"model": "gen_ai.request.model", "prompt_tokens": "gen_ai.usage.input_tokens",
             "completion_tokens": "gen_ai.usage.output_tokens", "client": "client.address"}
_SERVER, _CLIENT = 2, 3  # OTLP span kinds
_ERROR = 2  # OTLP status code
_BATCH = 64  # spans per export request (encoding one holds the event loop ~0.5 ms)
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ids = random.Random(os.urandom(16))


@dataclass(frozen=True, slots=True)
class SpanContext:
    """Where a span sits in its trace (W3C trace context)."""

    trace_id: int
    span_id: int
    sampled: bool
    state: str = ""  # the caller's `tracestate`, passed on as it came

    def traceparent(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.sampled else '00'}"


def parse_traceparent(value: str | None, state: str | None = None) -> SpanContext | None:
    """The caller's span from its `traceparent` header; None when absent or invalid
    (W3C Trace Context: version ff and all-zero ids are invalid; a later version may
    carry more fields after the four)."""
    match = _TRACEPARENT.fullmatch(value.strip().lower()) if value else None
    if match is None:
        return None
    version, trace_id, span_id, flags, more = match.groups()
    if version == "ff" or (version == "00" and more) or not int(trace_id, 16) \
            or not int(span_id, 16):
        return None
    return SpanContext(int(trace_id, 16), int(span_id, 16), bool(int(flags, 16) & 1),
                       state or "")


class Span:
    """One recorded span; `end()` queues it for export."""

    __slots__ = ("_done", "attributes", "context", "end_ns", "events", "failure", "kind",
                 "name", "parent_id", "start_ns")

    def __init__(self, context: SpanContext, parent_id: int, name: str, kind: int,
                 attributes: dict[str, Any], done: Callable[[Span], None]) -> None:
        self.context, self.parent_id, self.name, self.kind = context, parent_id, name, kind
        self.start_ns, self.end_ns = time.time_ns(), 0
        self.attributes = attributes
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.failure: str | None = None  # the error status's message
        self._done = done

    def set_attribute(self, key: str, value: Any) -> None:
        if not self.end_ns:
            self.attributes[key] = value

    def add_event(self, name: str, attributes: dict[str, Any]) -> None:
        if not self.end_ns:
            self.events.append((time.time_ns(), name, attributes))

    def fail(self, kind: str, detail: str) -> None:
        """Its status: an error (`kind`, as in UpstreamFailure, or an HTTP status)."""
        if not self.end_ns:
            self.attributes["error.type"] = kind
            self.failure = detail[:300]

    def end(self) -> None:
        if not self.end_ns:
            self.end_ns = time.time_ns()
            self._done(self)


# The request being served: its recorded span, or the context of one not sampled.
_current: ContextVar[Span | SpanContext | None] = ContextVar("laneway_span", default=None)


def current_span() -> Span | None:
    """The recorded span of the request being served, if there is one (for an event)."""
    span = _current.get()
    return span if isinstance(span, Span) else None


class Tracing:
    """The spans of one proxy process and their export (started by `start`)."""

    def __init__(self, cfg: TracingConfig, dropped: Callable[[int], None] = lambda n: None
                 ) -> None:
        assert cfg.otlp_endpoint is not None
        self.cfg = cfg
        self._bound = round(cfg.sample_ratio * 2**64)  # OpenTelemetry's TraceIdRatioBased
        self._queue: list[bytes] = []  # finished spans, each as OTLP/JSON
        self._dropped = dropped
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._failing_since: float | None = None
        self._events = _SpanEvents()

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s),
            headers={"content-type": "application/json", **self.cfg.headers})
        self._task = asyncio.create_task(self._run(), name="laneway-tracing")
        logging.getLogger(_EVENTS_FROM).addHandler(self._events)
        log.info("tracing: spans to %s (service %s, %.0f%% of new traces)",
                 self.cfg.otlp_endpoint, self.cfg.service_name, self.cfg.sample_ratio * 100)

    async def close(self) -> None:
        """Send what is queued (at most `timeout_s`), then stop."""
        logging.getLogger(_EVENTS_FROM).removeHandler(self._events)
        await stop_task(self._task)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.cfg.timeout_s):
                while self._queue and await self._export():
                    pass
        if self._queue:  # the collector did not take them in time: counted as dropped
            self._dropped(len(self._queue))
            self._queue = []
        if self._session is not None:
            await self._session.close()

    # -- spans ---------------------------------------------------------------------
    async def traced(self, app: Http, scope: Scope, receive: Receive, send: Send) -> None:
        """Run `app` on the request inside its span (the current span while it runs)."""
        headers = header_map(scope)
        caller = parse_traceparent(headers.get("traceparent"), headers.get("tracestate"))
        if caller is None:
            trace_id = _ids.getrandbits(128) or 1
            context = SpanContext(trace_id, _new_id(), trace_id & (2**64 - 1) < self._bound)
        else:
            context = SpanContext(caller.trace_id, _new_id(), caller.sampled, caller.state)
        if not context.sampled:  # not recorded; its context still goes to the backends
            token = _current.set(context)
            try:
                await app(scope, receive, send)
            finally:
                _current.reset(token)
            return
        path = scope["path"]
        route = "/v1/responses/{id}" if path.startswith("/v1/responses/") else path
        span = Span(context, caller.span_id if caller else 0, f"{scope['method']} {route}",
                    _SERVER, {"http.request.method": scope["method"], "url.path": path,
                              "http.route": route}, self._ended)
        if NOTES not in scope:  # the access log is off: the span takes the notes alone
            scope[NOTES] = {}
        note(scope, trace_id=f"{context.trace_id:032x}")
        status: list[int] = []

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                for name, value in message.get("headers", ()):
                    if name == b"x-laneway-backend":  # the one that answered
                        span.attributes["laneway.backend"] = value.decode("latin-1")
            await send(message)

        token = _current.set(span)
        try:
            await app(scope, receive, watched)
        except BaseException as exc:
            span.add_event("exception", {"exception.type": type(exc).__name__,
                                         "exception.message": str(exc)[:300]})
            if not status and isinstance(exc, Exception):  # the app answers it: a 500
                status.append(500)
            raise
        finally:
            _current.reset(token)
            _finish(span, status[0] if status else 499, scope[NOTES])

    @contextlib.contextmanager
    def attempt(self, backend: Backend, method: str, path: str,
                headers: dict[str, str]) -> Iterator[tuple[Span | None, dict[str, str]]]:
        """A CLIENT span for a request to `backend` made while serving a sampled request
        (none for the poller's and other background requests), and `headers` with its
        `traceparent` (an unsampled request's own, flagged so, so that a backend that
        traces drops it too). The span ends here only when the request failed; else the
        caller ends it once the answer is read."""
        current = _current.get()
        if current is None:
            yield None, headers
            return
        if isinstance(current, SpanContext):
            yield None, headers | _propagated(current)
            return
        span = Span(SpanContext(current.context.trace_id, _new_id(), True,
                                current.context.state),
                    current.context.span_id, f"{method} {path}", _CLIENT,
                    {"laneway.backend": backend.name, "laneway.backend_model": backend.model,
                     "url.full": backend.url + path, "http.request.method": method},
                    self._ended)
        try:
            yield span, headers | _propagated(span.context)
        except BaseException as exc:
            if (status := getattr(exc, "status", None)) is not None:
                span.attributes["http.response.status_code"] = status
            span.fail(getattr(exc, "kind", type(exc).__name__), str(exc))
            span.end()
            raise

    def _ended(self, span: Span) -> None:
        """Queue the span, encoded now: a little work after each request instead of a
        whole batch's at once, which would hold the event loop for a millisecond."""
        if len(self._queue) >= self.cfg.max_queued_spans:
            self._dropped(1)
            return
        self._queue.append(orjson.dumps(_span(span)))

    # -- export --------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.export_interval_s)
            while self._queue and await self._export():  # a backlog: batch after batch
                pass

    async def _export(self) -> bool:
        """POST one batch; whether the collector took it (a failed batch is dropped)."""
        assert self._session is not None and self.cfg.otlp_endpoint is not None
        batch, self._queue = self._queue[:_BATCH], self._queue[_BATCH:]
        try:
            async with self._session.post(self.cfg.otlp_endpoint,
                                          data=export_body(batch, self.cfg.service_name)
                                          ) as answer:
                await answer.read()
                if answer.status >= 300:
                    raise aiohttp.ClientResponseError(answer.request_info, (),
                                                      status=answer.status)
        except asyncio.CancelledError:  # stopped mid-export (`close`): sent again there
            self._queue[:0] = batch
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._dropped(len(batch))
            if self._failing_since is None:
                self._failing_since = time.monotonic()
                log.warning("tracing: the collector at %s did not take %d spans (%r); "
                            "spans are dropped until it does", self.cfg.otlp_endpoint,
                            len(batch), exc)
            return False
        if self._failing_since is not None:
            log.warning("tracing: the collector takes spans again (after %.0f s)",
                        time.monotonic() - self._failing_since)
            self._failing_since = None
        return True


def _new_id() -> int:
    return _ids.getrandbits(64) or 1


def _propagated(context: SpanContext) -> dict[str, str]:
    headers = {"traceparent": context.traceparent()}
    if context.state:
        headers["tracestate"] = context.state
    return headers


def answered(span: Span, status: int) -> None:
    """A CLIENT span's answer: an error from 400 up, as OpenTelemetry's HTTP conventions
    have it for a client (a SERVER span's only from 500: `_finish`)."""
    span.set_attribute("http.response.status_code", status)
    if status >= 400:
        span.fail(str(status), f"HTTP {status}")


def _finish(span: Span, status: int, notes: Mapping[str, Any]) -> None:
    span.attributes["http.response.status_code"] = status
    for key, value in notes.items():
        if key != "trace_id" and isinstance(value, str | bool | int | float):
            span.attributes[_STANDARD.get(key, f"laneway.{key}")] = value
    if status >= 500:
        span.fail(str(status), f"HTTP {status}")
    elif notes.get("stream_failed"):
        span.fail("stream", "the stream ended with an error event")
    span.end()


# -- OTLP/JSON (opentelemetry-proto's JSON mapping: ids in hex, 64-bit ints as strings) --
def export_body(spans: list[bytes], service: str) -> bytes:
    """An ExportTraceServiceRequest of `spans` (each already encoded by `_span`), as
    OTLP/HTTP's JSON body."""
    resource = orjson.dumps({"attributes": _attributes({"service.name": service})})
    return b'{"resourceSpans":[{"resource":%b,"scopeSpans":[{"scope":{"name":"laneway"},' \
        b'"spans":[%b]}]}]}' % (resource, b",".join(spans))


def _span(span: Span) -> dict[str, Any]:
    context = span.context
    encoded: dict[str, Any] = {
        "traceId": f"{context.trace_id:032x}", "spanId": f"{context.span_id:016x}",
        "name": span.name, "kind": span.kind,
        "startTimeUnixNano": str(span.start_ns), "endTimeUnixNano": str(span.end_ns),
        "attributes": _attributes(span.attributes),
    }
    if span.parent_id:
        encoded["parentSpanId"] = f"{span.parent_id:016x}"
    if context.state:
        encoded["traceState"] = context.state
    if span.events:
        encoded["events"] = [{"timeUnixNano": str(at), "name": name,
                              "attributes": _attributes(attributes)}
                             for at, name, attributes in span.events]
    if span.failure is not None:
        encoded["status"] = {"code": _ERROR, "message": span.failure}
    return encoded


def _attributes(attributes: Mapping[str, Any]) -> list[dict[str, Any]]:
    encoded = []
    for key, value in attributes.items():
        kind = type(value)  # (exact types: bool is not an int here)
        if kind is str:
            typed: dict[str, Any] = {"stringValue": value}
        elif kind is int:
            typed = {"intValue": str(value)}
        elif kind is bool:
            typed = {"boolValue": value}
        elif kind is float:
            typed = {"doubleValue": value}
        else:
            typed = {"stringValue": str(value)}
        encoded.append({"key": key, "value": typed})
    return encoded


class _SpanEvents(logging.Handler):
    """Log records made while a request's span is current become events on it."""

    def emit(self, record: logging.LogRecord) -> None:
        span = _current.get()
        if isinstance(span, Span):
            span.add_event(record.getMessage(), {"log.severity": record.levelname,
                                                 "log.logger": record.name})
