"""An OTLP/HTTP traces receiver: what a collector (Jaeger, Tempo, the OpenTelemetry
Collector) gets from the proxy and from vLLM, decoded with OpenTelemetry's own protobuf
definitions and kept for tests and benchmarks to read.

`POST /v1/traces` takes an `ExportTraceServiceRequest`, as binary protobuf (vLLM's
exporter) or as OTLP/JSON (the proxy's), and answers an empty
`ExportTraceServiceResponse`; a body it cannot decode is a 400, kept in `refused`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from google.protobuf import json_format  # type: ignore[import-untyped]
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


@dataclass(frozen=True, slots=True)
class SpanSeen:
    service: str
    name: str
    kind: str
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_id: str  # "" for a root span
    attributes: dict[str, Any]
    error: bool  # its status is ERROR
    events: tuple[str, ...]  # their names (laneway: the log lines, "routed")
    duration_s: float
    event_attributes: tuple[dict[str, Any], ...] = ()  # each event's, in order


@dataclass
class OtlpSink:
    spans: list[SpanSeen] = field(default_factory=list)
    exports: int = 0
    refused: list[str] = field(default_factory=list)  # exports it could not decode
    counting: bool = False  # only count the spans of JSON exports (benchmarks: cheap)
    counted: int = 0
    stalled: int = 0  # exports held back (`serve_sink(stall_first_s=...)`)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, payload: bytes, json: bool = False) -> None:
        """One export: binary protobuf, or OTLP/JSON (`json`; checked against the same
        definitions, strictly: an unknown field or a wrong type is an error)."""
        if json and self.counting:  # (protobuf's JSON parser costs ~0.1 ms a span)
            export = orjson.loads(payload)
            self.counted += sum(len(scope["spans"]) for resource in export["resourceSpans"]
                                for scope in resource["scopeSpans"])
            self.exports += 1
            return
        request = ExportTraceServiceRequest()
        if json:
            json_format.ParseDict(_ids_in_base64(orjson.loads(payload)), request)
        else:
            request.ParseFromString(payload)
        seen: list[SpanSeen] = []
        for resource in request.resource_spans:
            service = next((_value(a.value) for a in resource.resource.attributes
                            if a.key == "service.name"), "")
            for scope in resource.scope_spans:
                for span in scope.spans:
                    seen.append(SpanSeen(
                        service=str(service), name=span.name, kind=KINDS.get(span.kind, "?"),
                        trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        error=span.status.code == 2,
                        events=tuple(e.name for e in span.events),
                        duration_s=(span.end_time_unix_nano - span.start_time_unix_nano) / 1e9,
                        event_attributes=tuple({a.key: _value(a.value) for a in e.attributes}
                                               for e in span.events)))
        with self._lock:
            self.spans.extend(seen)
            self.exports += 1

    def trace(self, trace_id: str) -> list[SpanSeen]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    async def until(self, found: Callable[[list[SpanSeen]], bool], timeout_s: float = 20.0
                    ) -> list[SpanSeen]:
        """The spans once `found(spans)` holds (exports come in batches, late); the
        spans so far after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = list(self.spans)
            if found(spans) or time.monotonic() > deadline:
                return spans
            await asyncio.sleep(0.05)


def _ids_in_base64(export: dict[str, Any]) -> dict[str, Any]:
    """OTLP/JSON's hex trace and span ids as protobuf's JSON mapping has bytes: base64."""
    for resource in export.get("resourceSpans", ()):
        for scope in resource.get("scopeSpans", ()):
            for span in scope.get("spans", ()):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return export


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


@contextlib.asynccontextmanager
async def serve_sink(port: int = 0, counting: bool = False, stall_first_s: float = 0.0
                     ) -> AsyncIterator[tuple[OtlpSink, str]]:
    """(the sink, its traces URL: what `otlp_endpoint` and vLLM's
    `--otlp-traces-endpoint` take) while the block runs. `stall_first_s`: the first
    export is held that long before it is read (a collector slow to answer; tests)."""
    sink = OtlpSink(counting=counting)
    closing = asyncio.Event()  # a held export stops waiting when the sink stops

    async def traces(request: web.Request) -> web.Response:
        json = request.content_type == "application/json"
        if stall_first_s and not sink.stalled:
            sink.stalled += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(closing.wait(), stall_first_s)
        try:
            sink.add(await request.read(), json)
        except (json_format.ParseError, ValueError) as exc:  # as a collector refuses it
            sink.refused.append(str(exc))
            return web.Response(status=400, text=str(exc))
        if json:
            return web.json_response({})
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"spans": len(sink.spans) + sink.counted,
                                  "exports": sink.exports,
                                  "refused": len(sink.refused)})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield sink, f"http://127.0.0.1:{bound}/v1/traces"
    finally:
        closing.set()
        await runner.cleanup()


async def _forever(port: int, quiet: bool) -> None:
    async with serve_sink(port, counting=quiet) as (sink, url):
        print(f"OTLP/HTTP traces at {url}", flush=True)
        shown = 0
        while True:
            await asyncio.sleep(1)
            for span in [] if quiet else sink.spans[shown:]:
                print(f"{span.trace_id[:8]} {span.service:10} {span.kind:6} {span.name} "
                      f"{span.duration_s * 1000:.1f} ms", flush=True)
            shown = len(sink.spans)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="An OTLP/HTTP traces receiver that prints "
                                     "the spans it gets (GET /health: how many)")
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--quiet", action="store_true", help="count them only (JSON "
                        "exports: not checked against the protobuf definitions)")
    args = parser.parse_args()
    asyncio.run(_forever(args.port, args.quiet))
