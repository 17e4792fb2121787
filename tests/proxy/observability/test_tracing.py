"""Tracing (proxy/observability/tracing.py): the spans the proxy exports over OTLP/HTTP to a
receiver
(bench/fakes/otlp_sink.py, decoding the real protobuf), their parents and attributes, and the
`traceparent` each fake backend got; sampling; a collector that is down."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
import pytest

from bench.fakes.fake_vllm import FakeConfig
from bench.fakes.otlp_sink import OtlpSink, SpanSeen, serve_sink
from proxy.http.server import RunningProxy
from proxy.observability.tracing import SpanContext, parse_traceparent
from tests.proxy.fakes import CHAT, fleet, post

TRACE, CALLER = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
STREAM = {**CHAT, "stream": True, "max_tokens": 8}


def traced(url: str, **cfg: Any) -> dict[str, Any]:
    return {"otlp_endpoint": url, "export_interval_s": 0.05, **cfg}


async def spans_of(sink: OtlpSink, trace_id: str, clients: int = 1) -> list[SpanSeen]:
    """The trace's spans once its request span and `clients` backend requests are in."""
    def done(spans: list[SpanSeen]) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        return any(s.kind == "server" for s in mine) and \
            sum(s.kind == "client" for s in mine) >= clients
    await sink.until(done, timeout_s=10)
    assert not sink.refused  # every export decoded as OTLP, strictly
    return sink.trace(trace_id)


def one(spans: list[SpanSeen], kind: str) -> SpanSeen:
    (span,) = [s for s in spans if s.kind == kind]
    return span


async def test_a_request_is_a_span_under_the_callers_with_its_backend_request_under_it(
) -> None:
    async with serve_sink() as (sink, url), fleet(
            FakeConfig(), tracing=traced(url)) as (proxy, fakes):
        answer = await post(proxy, STREAM, headers={"traceparent": f"00-{TRACE}-{CALLER}-01"})
        assert answer.status_code == 200 and "data: [DONE]" in answer.text
        spans = await spans_of(sink, TRACE)
    request, upstream = one(spans, "server"), one(spans, "client")
    assert (request.name, request.parent_id, request.service) == (
        "POST /v1/chat/completions", CALLER, "laneway")
    assert request.attributes["gen_ai.request.model"] == "fake"
    assert request.attributes["laneway.backend"] == "f0"
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["gen_ai.usage.output_tokens"] == 8
    assert request.attributes["laneway.policy"] == "round_robin"
    assert not request.error
    (routed,) = [a for e, a in zip(request.events, request.event_attributes, strict=True)
                 if e == "routed"]  # the policy's decision and why
    assert routed["laneway.backend"] == "f0" and routed["laneway.reason"] == "round robin"
    assert routed["laneway.candidates"] == 1 and routed["laneway.decision_us"] > 0
    assert upstream.parent_id == request.span_id
    assert upstream.attributes["laneway.backend"] == "f0"
    assert upstream.attributes["http.response.status_code"] == 200
    assert upstream.attributes["url.full"] == fakes[0].url + "/v1/chat/completions"
    # the backend got the proxy's span as its parent, in the caller's trace
    assert fakes[0].app.stats.traceparents[-1] == f"00-{TRACE}-{upstream.span_id}-01"
    # the backend request lasted the whole stream: it is inside the request's span
    assert 0 < upstream.duration_s <= request.duration_s


async def test_a_retry_elsewhere_is_a_second_backend_span_and_the_failure_an_event(
) -> None:
    async with serve_sink() as (sink, url), fleet(
            FakeConfig(fail_status=500), FakeConfig(), tracing=traced(url)) as (proxy, fakes):
        answer = await post(proxy, STREAM, headers={"traceparent": f"00-{TRACE}-{CALLER}-01"})
        assert answer.status_code == 200 and answer.headers["x-laneway-backend"] == "f1"
        spans = await spans_of(sink, TRACE, clients=2)
    request = one(spans, "server")
    failed, served = sorted((s for s in spans if s.kind == "client"),
                            key=lambda s: s.attributes["laneway.backend"])
    assert failed.attributes["laneway.backend"] == "f0" and failed.error
    assert failed.attributes["http.response.status_code"] == 500
    assert failed.attributes["error.type"] == "status"
    assert served.attributes["laneway.backend"] == "f1" and not served.error
    assert {failed.parent_id, served.parent_id} == {request.span_id}
    assert not request.error and request.attributes["laneway.backend"] == "f1"
    assert any(e.startswith("attempt on f0 failed (status)") for e in request.events)
    assert [a["laneway.backend"] for e, a in zip(request.events, request.event_attributes,
                                                 strict=True) if e == "routed"] == ["f0", "f1"]
    assert fakes[1].app.stats.traceparents[-1] == f"00-{TRACE}-{served.span_id}-01"


async def test_a_migration_is_the_broken_backend_request_then_its_continuation() -> None:
    async with serve_sink() as (sink, url), fleet(
            FakeConfig(die_after_tokens=3), FakeConfig(), tracing=traced(url)) as (proxy, _):
        answer = await post(proxy, {**STREAM, "max_tokens": 10})
        assert answer.status_code == 200 and "error" not in answer.text
        await sink.until(lambda spans: any(s.kind == "server" for s in spans))
        (request,) = [s for s in sink.spans if s.kind == "server"]
        spans = await spans_of(sink, request.trace_id, clients=2)
    assert request.parent_id == "" and request.attributes["laneway.migrations"] == 1
    legs = [s for s in spans if s.kind == "client" and s.name.endswith("/completions")]
    broken, continued = sorted(legs, key=lambda s: s.attributes["laneway.backend"])
    assert broken.attributes["laneway.backend"] == "f0" and broken.error
    assert broken.attributes["error.type"] == "broken"
    assert continued.attributes["laneway.backend"] == "f1" and not continued.error
    assert all(s.parent_id == request.span_id for s in spans if s.kind == "client")
    assert not request.error


async def test_a_stream_that_ended_with_an_error_event_is_an_error_span() -> None:
    async with serve_sink() as (sink, url), fleet(
            FakeConfig(die_after_tokens=3), tracing=traced(url)) as (proxy, _):
        answer = await post(proxy, {**STREAM, "max_tokens": 10},
                            headers={"traceparent": f"00-{TRACE}-{CALLER}-01"})
        assert answer.status_code == 200 and "upstream_error" in answer.text
        request = one(await spans_of(sink, TRACE), "server")
    assert request.error and request.attributes["laneway.stream_failed"] is True
    assert request.attributes["http.response.status_code"] == 200


async def test_sampling_follows_the_callers_flag_and_the_ratio_for_new_traces() -> None:
    unsampled = f"00-{TRACE}-{CALLER}-00"
    async with serve_sink() as (sink, url), fleet(
            FakeConfig(), tracing=traced(url, sample_ratio=0.0)) as (proxy, fakes):
        for headers in ({}, {"traceparent": unsampled}):
            assert (await post(proxy, STREAM, headers=headers)).status_code == 200
        sampled = "4bf92f3577b34da6a3ce929d0e0e4737"
        answer = await post(proxy, STREAM, headers={"traceparent": f"00-{sampled}-{CALLER}-01"})
        assert answer.status_code == 200
        spans = await spans_of(sink, sampled)
    assert {s.trace_id for s in sink.spans} == {sampled} and len(spans) == 2
    new, kept, followed = (parts(p) for p in fakes[0].app.stats.traceparents[-3:])
    # not recorded, the context still goes on: the new trace's id, unsampled, and the
    # caller's trace (its flag kept), so a backend that traces does not start its own
    assert new[0] not in (TRACE, sampled) and not new[2]
    assert kept[0] == TRACE and not kept[2]
    assert followed[0] == sampled and followed[2]


def parts(traceparent: str | None) -> tuple[str, str, bool]:
    """(trace id, parent span id, sampled) of a W3C traceparent."""
    assert traceparent is not None
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00" and len(trace_id) == 32 and len(span_id) == 16
    return trace_id, span_id, bool(int(flags, 16) & 1)


async def test_without_tracing_the_callers_traceparent_is_forwarded_as_it_came() -> None:
    parent = f"00-{TRACE}-{CALLER}-01"
    async with fleet(FakeConfig()) as (proxy, fakes):
        assert (await post(proxy, STREAM, headers={"traceparent": parent})).status_code == 200
    assert fakes[0].app.stats.traceparents[-1] == parent


async def test_a_backends_client_error_marks_its_span_not_the_requests() -> None:
    """OpenTelemetry's HTTP conventions: a 4xx is an error of the CLIENT span that got it,
    and not of the SERVER span that relayed it (the caller's mistake, not the proxy's)."""
    async with serve_sink() as (sink, url), fleet(
            FakeConfig(fail_status=400), tracing=traced(url)) as (proxy, _):
        answer = await post(proxy, STREAM, headers={"traceparent": f"00-{TRACE}-{CALLER}-01"})
        assert answer.status_code == 400
        spans = await spans_of(sink, TRACE)
    request, upstream = one(spans, "server"), one(spans, "client")
    assert upstream.error and upstream.attributes["http.response.status_code"] == 400
    assert upstream.attributes["error.type"] == "400"
    assert not request.error and request.attributes["http.response.status_code"] == 400


async def test_spans_in_an_export_cut_by_the_shutdown_are_sent_again() -> None:
    """The proxy stops while an export waits on a slow collector: that batch is not lost
    (sent again by the shutdown's flush)."""
    async with serve_sink(stall_first_s=30.0) as (sink, url):
        async with fleet(FakeConfig(), tracing=traced(url, timeout_s=2.0)) as (proxy, _):
            answer = await post(proxy, STREAM, headers={
                "traceparent": f"00-{TRACE}-{CALLER}-01"})
            assert answer.status_code == 200
            deadline = time.monotonic() + 5
            while not sink.stalled:  # the export is on its way
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert await dropped(proxy) == 0
        assert sorted(s.kind for s in sink.trace(TRACE)) == ["client", "server"]
        assert not sink.refused


async def test_background_requests_to_backends_are_not_traced() -> None:
    """Discovery's /v1/models (outside any client request) makes no span."""
    async with serve_sink() as (sink, url), fleet(
            FakeConfig(), tracing=traced(url),
            poller={"models_interval_s": 0.05}) as (proxy, _):
        assert (await post(proxy, STREAM)).status_code == 200
        await sink.until(lambda spans: any(s.kind == "server" for s in spans))
        await sink.until(lambda spans: False, timeout_s=0.3)  # a few discoveries more
    assert [s.kind for s in sink.spans] == ["client", "server"]


@pytest.mark.parametrize("collector", ["refused", "silent"])
async def test_a_collector_that_is_down_costs_the_requests_nothing(collector: str) -> None:
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # never answers
    port = silent.sockets[0].getsockname()[1]
    if collector == "refused":
        silent.close()
        await silent.wait_closed()
    # an export held by the collector lasts timeout_s: a request that waited for one
    # would take that long; a slow machine takes ~0.1 s a request
    timeout_s = 2.0
    async with fleet(FakeConfig(), tracing=traced(f"http://127.0.0.1:{port}/v1/traces",
                                                  timeout_s=timeout_s)) as (proxy, _):
        slowest = 0.0
        for _ in range(20):
            sent = time.monotonic()
            answer = await post(proxy, STREAM)
            assert answer.status_code == 200 and "data: [DONE]" in answer.text
            slowest = max(slowest, time.monotonic() - sent)
        deadline = time.monotonic() + 3 * timeout_s
        while not await dropped(proxy):  # an export failed (refused, or timed out)
            assert time.monotonic() < deadline, "no export failed"
            await asyncio.sleep(0.1)
        stopping = time.monotonic()
    assert slowest < timeout_s  # no request waited for an export
    # the proxy's shutdown is held by one flush of at most timeout_s
    assert time.monotonic() - stopping < timeout_s + 1.5
    silent.close()


async def dropped(proxy: RunningProxy) -> float:
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        text = (await http.get("/metrics")).text
    (line,) = [x for x in text.splitlines() if x.startswith("laneway_trace_spans_dropped_total")]
    return float(line.split()[-1])


async def test_spans_over_the_queues_bound_are_dropped_and_counted() -> None:
    async with serve_sink() as (sink, url), fleet(FakeConfig(), tracing=traced(
            url, export_interval_s=60.0, max_queued_spans=3)) as (proxy, _):
        for _ in range(5):
            assert (await post(proxy, STREAM)).status_code == 200
        assert await dropped(proxy) == 2 * 5 - 3
    # the three kept were sent at shutdown
    assert len(sink.spans) == 3 and not sink.refused


async def test_the_access_line_names_the_trace_and_a_failed_stream(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "laneway.access")
    async with serve_sink() as (sink, url), fleet(
            FakeConfig(die_after_tokens=3), server={"access_log": True},
            tracing=traced(url)) as (proxy, _):
        answer = await post(proxy, STREAM, headers={"traceparent": f"00-{TRACE}-{CALLER}-01"})
        assert answer.status_code == 200
        await spans_of(sink, TRACE)
    (line,) = [r.fields for r in caplog.records  # type: ignore[attr-defined]
               if r.name == "laneway.access" and r.fields["path"] != "/metrics"]  # type: ignore[attr-defined]
    assert line["trace_id"] == TRACE and line["stream_failed"] is True


@pytest.mark.parametrize(("header", "parsed"), [
    (f"00-{TRACE}-{CALLER}-01", (int(TRACE, 16), int(CALLER, 16), True)),
    (f"00-{TRACE.upper()}-{CALLER}-00", (int(TRACE, 16), int(CALLER, 16), False)),
    (f" 00-{TRACE}-{CALLER}-03 ", (int(TRACE, 16), int(CALLER, 16), True)),  # other flags
    (f"01-{TRACE}-{CALLER}-01-more", (int(TRACE, 16), int(CALLER, 16), True)),  # a later version
    (f"00-{TRACE}-{CALLER}-01-more", None),  # version 00 has four fields
    (f"ff-{TRACE}-{CALLER}-01", None),
    (f"00-{'0' * 32}-{CALLER}-01", None),
    (f"00-{TRACE}-{'0' * 16}-01", None),
    (f"00-{TRACE[:-1]}-{CALLER}-01", None),
    ("junk", None), ("", None), (None, None),
])
def test_traceparent_headers_are_read_as_w3c_trace_context_says(
        header: str | None, parsed: tuple[int, int, bool] | None) -> None:
    context = parse_traceparent(header, "vendor=x")
    assert (None if context is None else
            (context.trace_id, context.span_id, context.sampled)) == parsed
    if context is not None:
        assert context.state == "vendor=x"


def test_a_span_context_writes_the_traceparent_it_read() -> None:
    context = SpanContext(int(TRACE, 16), int(CALLER, 16), True)
    assert context.traceparent() == f"00-{TRACE}-{CALLER}-01"
    assert parse_traceparent(context.traceparent()) == context
