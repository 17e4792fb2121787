"""The request path against in-process fake vLLM servers: relay, failover, errors."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from bench.fakes.fake_vllm import FakeConfig, serve_fake
from proxy.config import Settings
from proxy.http import app as app_module
from proxy.http.server import RunningProxy, serve_in_loop
from tests.proxy.fakes import ADMIN, CHAT, events, fleet, post


async def test_stream_is_relayed_unchanged() -> None:
    async with fleet(FakeConfig(tpot_s=0.001)) as (proxy, fakes):
        body = {**CHAT, "stream": True, "max_tokens": 20,
                "stream_options": {"include_usage": True}}
        via_proxy = await post(proxy, body)
        async with httpx.AsyncClient() as http:
            direct = await http.post(f"{fakes[0].url}/v1/chat/completions", json=body)
    assert via_proxy.status_code == 200
    assert via_proxy.headers["x-laneway-backend"] == "f0"
    assert via_proxy.headers["content-type"] == "text/event-stream"
    assert events(via_proxy.text) == events(direct.text)
    assert events(via_proxy.text)[-1] == "[DONE]"


async def test_every_field_reaches_the_backend_untouched() -> None:
    odd = {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
           "response_format": {"type": "json_object"}, "logprobs": True,
           "ignore_eos": True, "x_vendor": {"nested": [1, 2.5, None]}}
    async with fleet(FakeConfig()) as (proxy, fakes):
        response = await post(proxy, odd)
    assert response.status_code == 200
    assert fakes[0].app.stats.bodies == [odd]


async def test_non_stream_and_completions() -> None:
    async with fleet(FakeConfig()) as (proxy, _):
        chat = await post(proxy, {**CHAT, "max_tokens": 3})
        completion = await post(proxy, {"model": "fake", "prompt": "x", "max_tokens": 2},
                                "/v1/completions")
    assert chat.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
    assert completion.json()["choices"][0]["text"] == "tok0 tok1 "
    assert chat.headers["content-length"] == str(len(chat.content))


async def test_5xx_fails_over_before_first_byte() -> None:
    async with fleet(FakeConfig(fail_status=503), FakeConfig()) as (proxy, _):
        responses = [await post(proxy, {**CHAT, "stream": True}) for _ in range(4)]
        metrics = (await httpx.AsyncClient().get(f"{proxy.url}/metrics")).text
    assert all(r.status_code == 200 for r in responses)
    assert {r.headers["x-laneway-backend"] for r in responses} == {"f1"}
    assert 'laneway_retries_total{backend="f0",model="fake",reason="status"}' in metrics


async def test_unreachable_backend_fails_over_and_is_marked_down() -> None:
    dead = [{"name": "dead", "url": "http://127.0.0.1:9", "model": "fake"}]
    # Slow poller: the dead backend is found by the relay, not by a scrape.
    async with fleet(FakeConfig(), extra_backends=dead,
                     poller={"interval_s": 30}) as (proxy, _):
        proxy.app.runtime.registry.publish(  # type: ignore[union-attr]
            {**proxy.app.runtime.registry.stats,  # type: ignore[union-attr]
             "dead": proxy.app.runtime.registry.stats["f0"]})  # type: ignore[union-attr]
        responses = [await post(proxy, CHAT) for _ in range(4)]
        health = (await httpx.AsyncClient().get(f"{proxy.url}/admin/health",
                                                headers=ADMIN)).json()
    assert [r.status_code for r in responses] == [200] * 4
    assert health["backends"]["dead"]["healthy"] is False
    assert health["status"] == "degraded"


async def test_attempts_are_bounded_and_error_is_openai_shaped() -> None:
    failing = [FakeConfig(fail_status=500)] * 3
    async with fleet(*failing, upstream={"max_attempts": 2}) as (proxy, fakes):
        response = await post(proxy, CHAT)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_failed" and "HTTP 500" in error["message"]
    assert sum(f.app.stats.requests for f in fakes) == 2


async def test_backend_4xx_is_relayed_not_retried() -> None:
    async with fleet(FakeConfig(fail_status=400), FakeConfig()) as (proxy, fakes):
        response = await post(proxy, CHAT)
    assert response.status_code == 400
    assert response.json() == {"error": {"message": "injected failure"}}
    assert fakes[1].app.stats.requests == 0


async def test_mid_stream_death_ends_with_error_event() -> None:
    async with fleet(FakeConfig(die_after_tokens=3)) as (proxy, _):
        response = await post(proxy, {**CHAT, "stream": True, "max_tokens": 10})
    data = events(response.text)
    assert response.status_code == 200
    assert sum('"content":"tok' in e for e in data) == 3
    assert orjson.loads(data[-2])["error"]["type"] == "upstream_error"
    assert data[-1] == "[DONE]"


@pytest.mark.parametrize(("path", "body", "error"), [
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10}, '"type":"upstream_error"'),
    ("/v1/responses", {"model": "fake", "input": "hi", "max_output_tokens": 10},
     "event: error"),
    ("/v1/messages", {**CHAT, "max_tokens": 10}, "event: error"),
])
async def test_a_stream_that_ends_without_its_end_event_ends_with_an_error(
        path: str, body: dict[str, Any], error: str) -> None:
    async with fleet(FakeConfig(end_after_tokens=3)) as (proxy, _):
        rt = proxy.app.runtime
        assert rt is not None
        response = await post(proxy, {**body, "stream": True}, path)
        metrics = rt.metrics.render().decode()
    assert response.status_code == 200
    assert "tok2 " in response.text and "tok3" not in response.text
    assert error in response.text
    assert 'laneway_upstream_errors_total{backend="f0",kind="broken"} 1.0' in metrics
    assert 'status="502"' in metrics  # accounted as failed, not as a finished answer


async def test_stalled_stream_times_out_in_stream() -> None:
    async with fleet(FakeConfig(tpot_s=5.0), upstream={"read_timeout_s": 0.3}) as (proxy, _):
        response = await post(proxy, {**CHAT, "stream": True, "max_tokens": 5})
    data = events(response.text)
    assert "timeout" in orjson.loads(data[-2])["error"]["message"]


async def test_hanging_backend_times_out_then_fails_over() -> None:
    async with fleet(FakeConfig(hang=True), FakeConfig(),
                     upstream={"first_byte_timeout_s": 0.3}) as (proxy, _):
        response = await post(proxy, {**CHAT, "stream": True})
    assert response.status_code == 200 and response.headers["x-laneway-backend"] == "f1"


async def test_only_hanging_backends_give_504() -> None:
    async with fleet(FakeConfig(hang=True), upstream={"first_byte_timeout_s": 0.2}) as (proxy, _):
        response = await post(proxy, CHAT)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "upstream_timeout"


async def test_client_disconnect_cancels_upstream() -> None:
    async with fleet(FakeConfig(tpot_s=0.02)) as (proxy, fakes):
        stats = fakes[0].app.stats
        async with httpx.AsyncClient(base_url=proxy.url) as http, http.stream(
                "POST", "/v1/completions",
                json={"model": "fake", "prompt": "x", "max_tokens": 1000, "stream": True}
        ) as response:
            async for _ in response.aiter_lines():
                if stats.running:
                    break
        for _ in range(100):
            if stats.running == 0:
                break
            await asyncio.sleep(0.02)
        assert stats.running == 0 and stats.cancelled == 1 and stats.finished == 0
        assert proxy.app.runtime.registry.inflight["f0"] == 0  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        ("POST", "/v1/chat/completions", b"{bad", 400, None),
        ("POST", "/v1/chat/completions", orjson.dumps({**CHAT, "model": "other"}), 404,
         "model_not_found"),
        ("GET", "/v1/chat/completions", b"", 405, "method_not_allowed"),
        ("POST", "/v1/files", b"{}", 404, "not_found"),
        ("POST", "/v1/completions", b'{"model": "fake", "prompt": "' + b"x" * 3000 + b'"}',
         413, "request_too_large"),
    ],
)
async def test_proxy_errors(method: str, path: str, body: bytes, status: int,
                            code: str | None) -> None:
    async with fleet(FakeConfig(), server={"max_body_bytes": 2048}) as (proxy, fakes):
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            response = await http.request(method, path, content=body)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.json()["error"]["code"] == code
    assert fakes[0].app.stats.requests == 0


async def _slow_body(proxy: RunningProxy, path: str, chunks: int) -> tuple[bytes, float]:
    """Send `path` a 100-byte body 10 bytes every 0.1 s, `chunks` times; (what came back
    until the proxy closed, b"" if it reset the connection; seconds that took)."""
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {path} HTTP/1.1\r\nhost: localhost\r\n"  # (/admin: a host it
                 f"authorization: {ADMIN['authorization']}\r\n"  # knows, and its token)
                 "content-type: application/json\r\ncontent-length: 100\r\n\r\n".encode())
    started = asyncio.get_running_loop().time()

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            for _ in range(chunks):
                writer.write(b'{"model": ')
                await writer.drain()
                await asyncio.sleep(0.1)

    trickling = asyncio.create_task(trickle())
    try:
        answer = await asyncio.wait_for(reader.read(), 5)  # to EOF: the proxy closed it
    except ConnectionResetError:  # closed with our bytes unread: the kernel resets
        answer = b""
    waited = asyncio.get_running_loop().time() - started
    await trickling
    writer.close()
    return answer, waited


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings",
                                  "/admin/backends"])
async def test_a_body_that_stops_coming_is_a_408_and_the_connection_closes(path: str
                                                                           ) -> None:
    async with fleet(FakeConfig(), server={"body_timeout_s": 0.5}) as (proxy, fakes):
        answer, waited = await _slow_body(proxy, path, chunks=2)  # 20 of 100 bytes
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert orjson.loads(body)["error"]["code"] == "request_timeout"
    assert 0.5 <= waited < 2
    assert fakes[0].app.stats.requests == 0


async def test_a_trickled_body_does_not_hold_the_connection() -> None:
    async with fleet(FakeConfig(), server={"body_timeout_s": 0.3}) as (proxy, fakes):
        _, waited = await _slow_body(proxy, "/v1/chat/completions", chunks=9)
    assert waited < 0.8  # closed mid-trickle, not after the 0.9 s it would take
    assert fakes[0].app.stats.requests == 0


async def _connect(proxy: RunningProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = proxy.url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
           b"\r\ncontent-length: " + str(len(orjson.dumps(CHAT))).encode() + b"\r\n\r\n"
           + orjson.dumps(CHAT))


async def _response(reader: asyncio.StreamReader) -> bytes:
    """One whole HTTP/1.1 response with a content-length."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return head + await reader.readexactly(length)


async def test_headers_that_do_not_finish_in_time_are_a_408_and_close() -> None:
    """`server.header_timeout_s` (slowloris): a connection that never finishes its
    headers gets a 408 and is closed; one that sends nothing is closed."""
    async with fleet(FakeConfig(), server={"header_timeout_s": 0.3}) as (proxy, fakes):
        reader, writer = await _connect(proxy)
        writer.write(REQUEST[:40])  # headers begun, never finished
        answer = await asyncio.wait_for(reader.read(), 3)  # to EOF: closed
        writer.close()
        silent_reader, silent = await _connect(proxy)
        nothing = await asyncio.wait_for(silent_reader.read(), 3)
        silent.close()
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            metrics = (await http.get("/metrics")).text
    head, _, body = answer.partition(b"\r\n\r\n")
    assert 'laneway_error_responses_total{code="request_timeout",status="408"} 1.0' in metrics
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head
    assert orjson.loads(body)["error"]["code"] == "request_timeout"
    assert nothing == b""
    assert fakes[0].app.stats.requests == 0


async def test_the_header_deadline_waits_for_the_answer_going_out() -> None:
    """A client that begins its next request while a stream is still coming does not
    lose the stream: the next request's deadline runs from the stream's end."""
    streamed = orjson.dumps({**CHAT, "stream": True, "max_tokens": 40})
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: "
               + str(len(streamed)).encode() + b"\r\n\r\n" + streamed)
    async with fleet(FakeConfig(tpot_s=0.02), server={"header_timeout_s": 0.3}) as (
            proxy, fakes):
        reader, writer = await _connect(proxy)
        writer.write(request)
        await reader.readuntil(b"data: ")  # streaming (40 tokens: ~0.8 s)
        writer.write(REQUEST[:40])  # the next request, begun and never finished
        answer = await asyncio.wait_for(reader.read(), 5)  # to EOF: closed
        writer.close()
    stream, _, after = answer.partition(b"data: [DONE]\n\n")
    assert after, "the stream was cut"
    assert stream.count(b'"finish_reason":"length"') == 1
    assert b"HTTP/1.1 408 " in after  # then the next request's deadline ran out
    assert fakes[0].app.stats.requests == 1


async def test_the_header_deadline_spares_slow_headers_and_idle_keep_alive() -> None:
    """Headers that finish in time are served, and a kept-alive connection's idle time
    between requests does not count against the next request's headers."""
    async with fleet(FakeConfig(), server={"header_timeout_s": 0.5}) as (proxy, fakes):
        reader, writer = await _connect(proxy)
        for at in range(0, len(REQUEST), 40):  # the first request trickled over 0.3 s
            writer.write(REQUEST[at:at + 40])
            await asyncio.sleep(0.3 * 40 / len(REQUEST))
        first = await _response(reader)
        await asyncio.sleep(0.8)  # idle, kept alive past the header deadline
        writer.write(REQUEST)
        second = await _response(reader)
        writer.close()
    assert first.startswith(b"HTTP/1.1 200 ") and second.startswith(b"HTTP/1.1 200 ")
    assert fakes[0].app.stats.requests == 2


async def test_models_and_no_healthy_backend() -> None:
    ghost = [{"name": "ghost", "url": "http://127.0.0.1:9", "model": "ghost-model"}]
    async with fleet(FakeConfig(), extra_backends=ghost) as (proxy, _):
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            models = (await http.get("/v1/models")).json()
            response = await http.post("/v1/chat/completions",
                                       json={**CHAT, "model": "ghost-model"})
    assert [m["id"] for m in models["data"]] == ["fake"]
    assert response.status_code == 503 and response.headers["retry-after"] == "1"


async def test_livez_answers_while_health_says_no_backend_is_up() -> None:
    ghost = {"name": "ghost", "url": "http://127.0.0.1:9", "model": "ghost-model"}
    settings = Settings(server={"port": 0}, backends=[ghost])  # type: ignore[arg-type, list-item]
    async with serve_in_loop(settings) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
        health, live = await http.get("/health"), await http.get("/livez")
    assert health.status_code == 503  # readiness: no backend to route to
    assert live.status_code == 200 and live.json() == {"status": "ok"}  # liveness


# The hop decides per connection; a GET of /v1/models would open a connection it
# passes through, which the relay's pool then reuses for the POST.
NO_DISCOVERY = {"models_interval_s": 0}


@contextlib.asynccontextmanager
async def dropping_hop(upstream: str, drop_first: int) -> AsyncIterator[str]:
    """A TCP hop to `upstream` that closes the connections of its first `drop_first`
    POSTs as soon as they arrive, as a backend closing a stale keep-alive connection
    does (the poller's GETs pass)."""
    host, port = upstream.removeprefix("http://").split(":")
    accepted = 0

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        first = await reader.read(65536)
        accepted += first.startswith(b"POST")
        if first.startswith(b"POST") and accepted <= drop_first:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        up_writer.write(first)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def behind_hop(hop: str) -> Settings:
    """The proxy's settings with one backend, `only`, behind a dropping hop."""
    return Settings(server={"port": 0},  # type: ignore[arg-type]
                    backends=[{"name": "only", "url": hop, "model": "fake"}],  # type: ignore[list-item]
                    poller=NO_DISCOVERY)  # type: ignore[arg-type]


async def test_connection_closed_before_response_is_retried_on_same_backend() -> None:
    async with serve_fake(FakeConfig()) as fake, dropping_hop(fake.url, 1) as hop:
        async with serve_in_loop(behind_hop(hop)) as proxy:
            response = await post(proxy, CHAT)
    assert response.status_code == 200 and fake.app.stats.requests == 1


async def test_several_stale_connections_in_a_row_are_each_tried_again() -> None:
    """As after a proxy fell behind: many pooled connections the backend closed at once.
    Each failed try drops one; the request still reaches the backend, once."""
    from proxy.relay.upstream import STALE_RETRIES

    async with serve_fake(FakeConfig()) as fake, \
            dropping_hop(fake.url, STALE_RETRIES) as hop:
        async with serve_in_loop(behind_hop(hop)) as proxy:
            response = await post(proxy, CHAT)
    assert response.status_code == 200 and fake.app.stats.requests == 1


def test_a_stale_connection_is_told_from_a_down_backend() -> None:
    import aiohttp

    from proxy.relay.upstream import stale_connection

    key = aiohttp.client_reqrep.ConnectionKey("h", 1, False, True, None, None, None)
    assert stale_connection(aiohttp.ServerDisconnectedError())
    assert stale_connection(aiohttp.ClientOSError(None, "Can not write request body"))
    assert not stale_connection(aiohttp.ClientConnectorError(key, OSError(111, "refused")))
    assert not stale_connection(aiohttp.ClientPayloadError("broken body"))
    assert not stale_connection(TimeoutError())


async def test_backend_that_always_drops_gives_502() -> None:
    async with serve_fake(FakeConfig()) as fake, dropping_hop(fake.url, 99) as hop:
        async with serve_in_loop(behind_hop(hop)) as proxy:
            response = await post(proxy, CHAT)
    assert response.status_code == 502
    assert "only: broken" in response.json()["error"]["message"]


async def test_a_model_group_routes_over_its_models_and_names_each_backends() -> None:
    groups = {"model_groups": {"team": ["a", "b"]}}
    async with fleet(FakeConfig(model="a"), FakeConfig(model="b"), **groups) as (proxy, fakes):
        chat = {**CHAT, "model": "team", "max_tokens": 3}
        responses = [await post(proxy, chat), await post(proxy, {**chat, "stream": True})]
        responses += [await post(proxy, {"model": "team", "prompt": "x", "max_tokens": 2},
                                 "/v1/completions")]
        listed = (await httpx.AsyncClient().get(f"{proxy.url}/v1/models")).json()
    assert [r.status_code for r in responses] == [200] * 3
    assert [r.headers["x-laneway-backend"] for r in responses] == ["f0", "f1", "f0"]
    assert responses[0].json()["model"] == "a"  # the answer names the model that served it
    assert [b["model"] for b in fakes[0].app.stats.bodies] == ["a", "a"]
    assert [b["model"] for b in fakes[1].app.stats.bodies] == ["b"]
    assert {m["id"] for m in listed["data"]} == {"a", "b", "team"}


@pytest.mark.parametrize("panic", [True, False])
async def test_a_fleet_whose_scrapes_all_fail_still_serves_in_panic_mode(panic: bool) -> None:
    """Every backend marked unhealthy by its scrapes (a starved machine) but serving:
    panic mode routes anyway; without it the proxy answers 503 at once."""
    poller = {"interval_s": 30, "route_when_all_unhealthy": panic}
    async with fleet(FakeConfig(), FakeConfig(), poller=poller) as (proxy, _):
        runtime = proxy.app.runtime
        assert runtime is not None
        registry = runtime.registry
        # Start-up polls once, then the poller's first tick polls again at once: wait for
        # both rounds' answers (2 backends each) and their publication, or a late answer
        # would undo the publish below. The next round is 30 s away.
        for _ in range(500):
            if runtime.poller.scrapes >= 4:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        registry.publish({name: dataclasses.replace(stats, healthy=False)
                          for name, stats in registry.stats.items()})
        response = await post(proxy, CHAT)
    assert response.status_code == (200 if panic else 503)


@pytest.mark.parametrize("path", ["/v1/models", "/v1/messages"])
async def test_a_bug_is_answered_as_an_error_and_logged(
        path: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The last resort: an exception no handler expected is a JSON 500 in the route's
    shape (OpenAI's, Anthropic's on /v1/messages), logged with its traceback and
    counted, instead of uvicorn's plain-text 500."""
    async def broken(*_: object) -> None:
        raise KeyError("a bug")

    method = app_module.ROUTES[path][0]
    monkeypatch.setitem(app_module.ROUTES, path, (method, broken))
    async with fleet(FakeConfig()) as (proxy, _):
        async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as http:
            response = await http.request(method, path, json=CHAT)
            metrics = (await http.get("/metrics")).text
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == ("api_error" if path == "/v1/messages" else "internal_error")
    assert "internal error" in error["message"]
    (record,) = [r for r in caplog.records if r.getMessage().startswith("internal error")]
    assert record.exc_info is not None and path in record.getMessage()
    assert 'laneway_error_responses_total{code="internal_error",status="500"} 1.0' in metrics
