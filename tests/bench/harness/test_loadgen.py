"""The load generator against paced fake vLLM servers, the proxy, and scripted streams."""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
import pytest
import uvicorn

from bench.fakes.fake_vllm import FakeConfig, serve_fake
from bench.harness.loadgen import Limits, Progress, run, run_solo
from bench.harness.results import RequestResult
from bench.harness.sse_client import Target
from bench.harness.workloads import WorkloadRequest
from proxy.asgi import Receive, Scope, Send, read_body
from proxy.config import Settings
from proxy.http.server import serve_in_loop, uvicorn_in_loop


def requests(arrivals: Sequence[float], max_tokens: int = 5, **kw: Any) -> list[WorkloadRequest]:
    return [WorkloadRequest(i, f"r{i}", at, " hello there", 2, max_tokens, **kw)
            for i, at in enumerate(arrivals)]


async def collect(reqs: Sequence[WorkloadRequest], url: str, limits: Limits | None = None,
                  model: str = "fake", stream: io.StringIO | None = None
                  ) -> list[RequestResult]:
    got: list[RequestResult] = []
    await run(reqs, Target(url, model, timeout_s=10), limits or Limits(), got.append, stream)
    return sorted(got, key=lambda r: r.seq)


def max_overlap(results: Sequence[RequestResult]) -> int:
    edges = sorted([(r.sent_s, 1) for r in results] + [(r.sent_s + r.e2e_s, -1) for r in results])
    open_now = peak = 0
    for _, delta in edges:
        open_now += delta
        peak = max(peak, open_now)
    return peak


async def test_records_ttft_every_chunk_tpot_and_usage_against_a_paced_fake() -> None:
    async with serve_fake(FakeConfig(ttft_s=0.08, tpot_s=0.02)) as fake:
        [result] = await collect(requests([0.0], max_tokens=10), fake.url)
    assert result.ok and result.status == 200 and result.error is None
    assert result.output_tokens == 10 and result.prompt_tokens == 3  # BOS + 2 words
    assert len(result.chunk_times_s) == 10
    assert result.ttft_s == result.chunk_times_s[0]
    assert 0.08 <= result.ttft_s < 0.3
    # The fake paces on an absolute schedule, so a scheduling hiccup on a busy machine delays
    # one chunk and shortens the gaps after it (one of 69 ms in CI left two of ~0); what
    # must hold is that the chunks got their own time stamps at the fake's pace: stamps
    # taken in batches would make most gaps ~0.
    gaps = [b - a for a, b in zip(result.chunk_times_s, result.chunk_times_s[1:], strict=False)]
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(0.02, abs=0.008)
    assert sum(g <= 0.005 for g in gaps) <= len(gaps) // 3
    assert 0.012 <= result.tpot_s < 0.04
    assert result.e2e_s >= result.chunk_times_s[-1] >= 0.08 + 9 * 0.02 - 0.005
    assert result.backend is None and result.migrations == ()  # a bare vLLM names no backend


async def test_sends_at_the_arrival_times() -> None:
    arrivals = [0.0, 0.15, 0.3, 0.45]
    async with serve_fake(FakeConfig(tpot_s=0.001)) as fake:
        results = await collect(requests(arrivals), fake.url)
    assert [r.arrival_s for r in results] == arrivals
    # never early; late by less than the gap to the next arrival (a busy machine's
    # scheduling delay is tens of ms, a sender that waits for a wrong time is not)
    for result in results:
        assert result.arrival_s - 0.002 <= result.sent_s < result.arrival_s + 0.1


async def test_count_and_schedule_bounds() -> None:
    async with serve_fake(FakeConfig()) as fake:
        by_count = await collect(requests([0.01 * i for i in range(10)]), fake.url,
                                 Limits(max_requests=3))
        by_schedule = await collect(requests([0.0, 0.05, 0.1, 5.0]), fake.url,
                                    Limits(duration_s=0.2))
    assert [r.seq for r in by_count] == [0, 1, 2]
    assert [r.seq for r in by_schedule] == [0, 1, 2]


async def test_time_limit_cuts_open_requests_and_skips_the_rest() -> None:
    async with serve_fake(FakeConfig(tpot_s=0.05)) as fake:
        got: list[RequestResult] = []
        summary = await run(requests([0.0, 0.05, 2.0], max_tokens=100),
                            Target(fake.url, "fake", 10), Limits(time_limit_s=0.4),
                            got.append, None)
    assert summary.planned == 3 and summary.sent == 2 and summary.skipped == 1
    assert summary.wall_s < 1.0
    assert sorted(r.seq for r in got) == [0, 1]
    assert all(r.error == "cut at the run's time limit" for r in got)
    assert all(0 < len(r.chunk_times_s) < 100 for r in got)  # partial streams were kept


async def test_concurrency_caps_open_requests() -> None:
    async with serve_fake(FakeConfig(tpot_s=0.01)) as fake:
        capped = await collect(requests([0.0] * 6), fake.url, Limits(concurrency=2))
        open_loop = await collect(requests([0.0] * 6), fake.url)
    assert max_overlap(capped) <= 2 and all(r.ok for r in capped)
    assert max_overlap(open_loop) == 6


async def test_solo_sends_one_at_a_time_per_target_ignoring_arrivals() -> None:
    async def solo(urls: Sequence[str], reqs: Sequence[WorkloadRequest]) -> list[RequestResult]:
        got: list[RequestResult] = []
        summary = await run_solo(reqs, [Target(u, "fake", timeout_s=10) for u in urls],
                                 got.append, None)
        assert summary.sent == len(reqs) and summary.errors == 0
        return sorted(got, key=lambda r: r.seq)

    async with serve_fake(FakeConfig(tpot_s=0.005)) as one, \
            serve_fake(FakeConfig(tpot_s=0.005)) as two:
        alone = await solo([one.url], requests([0.0, 30.0, 60.0]))
        assert max_overlap(alone) == 1 and one.app.stats.requests == 3
        assert alone[-1].sent_s < 1.0  # arrivals 30 s and 60 s were not waited for
        both = await solo([one.url, two.url], requests([0.0, 30.0, 60.0, 90.0, 120.0]))
        # two lanes: never more than one request open on each, every request once,
        # and both backends used
        assert max_overlap(both) == 2 and [r.seq for r in both] == [0, 1, 2, 3, 4]
        assert one.app.stats.requests - 3 >= 2 and two.app.stats.requests >= 2
        assert one.app.stats.requests - 3 + two.app.stats.requests == 5
        assert one.app.stats.running == two.app.stats.running == 0
    with pytest.raises(ValueError, match="at least one target"):
        await run_solo(requests([0.0]), [], lambda _: None, None)


async def test_errors_are_recorded_not_raised() -> None:
    async with serve_fake(FakeConfig(fail_status=503)) as failing, \
            serve_fake(FakeConfig(die_after_tokens=3)) as dying:
        [refused] = await collect(requests([0.0]), failing.url)
        [broken] = await collect(requests([0.0], max_tokens=10), dying.url)
        [unknown] = await collect(requests([0.0]), dying.url, model="nope")
    assert refused.status == 503 and refused.error and "injected failure" in refused.error
    assert broken.status == 200 and broken.error and len(broken.chunk_times_s) == 3
    assert unknown.status == 404 and not unknown.ok


async def test_progress_bar_counts_done_and_errors() -> None:
    stream = io.StringIO()
    async with serve_fake(FakeConfig(fail_first=1, fail_status=500)) as fake:
        await collect(requests([0.0, 0.01, 0.02]), fake.url, stream=stream)
    final = stream.getvalue().rstrip("\n").rsplit("\r", 1)[-1]
    assert final.startswith("[" + "#" * 30 + "] 3/3 done, 0 open, 1 errors")
    bar = Progress(4, io.StringIO(), width=8)
    bar.on_sent()
    bar.on_done(True)
    assert bar.line().startswith("[##......] 1/4 done, 0 open, 0 errors")


async def test_backend_header_through_the_proxy() -> None:
    async with serve_fake(FakeConfig(model="m")) as a, serve_fake(FakeConfig(model="m")) as b:
        settings = Settings(server={"port": 0},
                            backends=[{"name": "fa", "url": a.url, "model": "m"},
                                      {"name": "fb", "url": b.url, "model": "m"}],
                            policy={"name": "round_robin"})
        async with serve_in_loop(settings) as proxy:
            results = await collect(requests([0.0, 0.05, 0.1, 0.15]), proxy.url, model="m")
    assert all(r.ok for r in results)
    assert sorted(r.backend or "" for r in results) == ["fa", "fa", "fb", "fb"]


async def test_migrations_through_the_proxy_are_recorded() -> None:
    slow = FakeConfig(model="m", tpot_s=0.02)
    async with serve_fake(slow) as a, serve_fake(slow) as b:
        settings = Settings(server={"port": 0},
                            backends=[{"name": "fa", "url": a.url, "model": "m"},
                                      {"name": "fb", "url": b.url, "model": "m"}],
                            policy={"name": "round_robin"},
                            debug={"allow_forced_migration": True})
        forced = Target("", "m", 10, (("x-laneway-migrate-after", "3"),))
        async with serve_in_loop(settings) as proxy:
            got: list[RequestResult] = []
            await run(requests([0.0, 0.01], max_tokens=12),
                      dataclasses.replace(forced, url=proxy.url), Limits(), got.append, None)
    for result in got:
        assert result.ok and result.output_tokens == 12 and len(result.chunk_times_s) == 12
        [move] = result.migrations
        assert move.from_backend == result.backend and move.reason == "forced"
        assert result.final_backend == ({"fa", "fb"} - {result.backend}).pop()
        assert move.at_token is not None and move.at_token >= 3
        assert result.chunk_times_s[2] <= move.at_s <= result.e2e_s


class ScriptedStream:
    """An upstream that answers every request with fixed SSE lines; keeps what it got."""

    def __init__(self, lines: Sequence[bytes]) -> None:
        self.lines = lines
        self.seen: list[tuple[dict[bytes, bytes], Any]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = orjson.loads(await read_body({}, receive, 1 << 20))
        self.seen.append((dict(scope["headers"]), body))
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"x-laneway-backend", b"A")]})
        for line in self.lines:
            await send({"type": "http.response.body", "body": line, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def chunk(text: str) -> bytes:
    return b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}) \
        + b"\n\n"


@contextlib.asynccontextmanager
async def scripted(lines: Sequence[bytes]) -> AsyncIterator[tuple[ScriptedStream, str]]:
    app = ScriptedStream(lines)
    async with uvicorn_in_loop(uvicorn.Config(app, host="127.0.0.1", port=0, loop="none",
                                              lifespan="off", log_config=None)) as url:
        yield app, url


async def test_migrations_come_from_laneway_comments_and_the_request_is_well_formed() -> None:
    migrated = {"event": "migrated", "from": "A", "to": "B", "at_token": 2, "reason": "slo"}
    lines = [chunk("x"), chunk("y"), b": laneway " + orjson.dumps(migrated) + b"\n\n",
             b": keep-alive\n\n", chunk("z w"),
             b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":4}}\n\n',
             b"data: [DONE]\n\n"]
    async with scripted(lines) as (app, url):
        [result] = await collect(requests([0.0], max_tokens=4, slo_s=2.5), url)
    assert result.ok and result.backend == "A" and result.final_backend == "B"
    [move] = result.migrations
    assert (move.from_backend, move.to_backend, move.at_token, move.reason) == ("A", "B", 2, "slo")
    assert result.chunk_times_s[1] <= move.at_s <= result.chunk_times_s[2]
    assert len(result.chunk_times_s) == 3 and result.output_tokens == 4  # 2 tokens in 1 event
    headers, body = app.seen[0]
    assert headers[b"x-laneway-events"] == b"1" and headers[b"x-laneway-slo-ms"] == b"2500"
    assert headers[b"x-laneway-expected-tokens"] == b"4"  # the oracle's hint
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 4 and body["model"] == "fake"
    assert body["messages"] == [{"role": "user", "content": " hello there"}]


async def test_a_stream_without_done_or_with_an_error_event_is_an_error() -> None:
    error = b'data: {"error": {"message": "backend broke", "type": "upstream_error"}}\n\n'
    async with scripted([chunk("x")]) as (_, cut_url), \
            scripted([chunk("x"), error, b"data: [DONE]\n\n"]) as (_, error_url):
        [cut] = await collect(requests([0.0]), cut_url)
        [failed] = await collect(requests([0.0]), error_url)
    assert cut.error == "stream ended without [DONE]"
    assert failed.error == "backend broke" and failed.ttft_s is not None


async def test_hidden_length_asks_for_more_and_stops_reading_at_the_requests_length() -> None:
    """--hide-length: the server is asked for 200 tokens (so a proxy cannot learn the
    answer length from max_tokens) and the client closes the stream at the request's 10,
    counting token ids; the usage event never comes, so the prompt length is the
    workload's plus the chat template's."""
    from bench.harness.sse_client import request_body
    from bench.models.lexicon import CHAT_TEMPLATE_TOKENS

    reqs = requests([0.0], max_tokens=10)
    target = Target("http://unused", "fake", timeout_s=10, hide_length=200)
    body = request_body(target, reqs[0])
    assert body["max_tokens"] == 200 and body["return_token_ids"] is True
    assert request_body(dataclasses.replace(target, hide_length=None), reqs[0])["max_tokens"] == 10
    async with serve_fake(FakeConfig(ttft_s=0.02, tpot_s=0.02)) as fake:
        got: list[RequestResult] = []
        await run(reqs, dataclasses.replace(target, url=fake.url), Limits(), got.append, None)
    [result] = got
    assert result.ok and result.error is None, result.error
    assert result.output_tokens == 10 and len(result.chunk_times_s) == 10
    assert result.e2e_s < 1.0  # 200 tokens would take 4 s
    assert result.prompt_tokens == reqs[0].prompt_tokens + CHAT_TEMPLATE_TOKENS
