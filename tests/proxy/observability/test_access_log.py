"""The access log (`server.access_log`): one line per HTTP request with what the proxy
decided and measured; `server.log_format: json` for every log line."""

from __future__ import annotations

import asyncio
import logging
import sys

import httpx
import orjson
import pytest

from bench.fakes.fake_vllm import FakeConfig
from proxy.observability.access_log import JsonFormatter, TextFormatter
from tests.proxy.admission.test_auth import bearer, keys
from tests.proxy.fakes import CHAT, fleet, post


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [r.fields for r in caplog.records if r.name == "laneway.access"]  # type: ignore[attr-defined]


async def test_one_line_per_request_with_its_route_and_tokens(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "laneway.access")
    async with fleet(FakeConfig(), FakeConfig(), server={"access_log": True},
                     auth=keys()) as (proxy, _):
        whole = await post(proxy, {**CHAT, "max_tokens": 3}, headers={
            **bearer("sk-alice"), "x-request-id": "req-1"})
        streamed = await post(proxy, {**CHAT, "max_tokens": 5, "stream": True},
                              headers=bearer("sk-alice"))
        unknown = await post(proxy, {**CHAT, "model": "nope"}, headers=bearer("sk-alice"))
        anonymous = await post(proxy, CHAT)
        embedded = await post(proxy, {"model": "fake", "input": "x"}, "/v1/embeddings",
                              headers=bearer("sk-alice"))
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            await http.get("/health")
    assert [whole.status_code, streamed.status_code, unknown.status_code,
            anonymous.status_code, embedded.status_code] == [200, 200, 404, 401, 200]
    lines = access_lines(caplog)
    assert [(x["method"], x["path"], x["status"]) for x in lines] == [
        ("POST", "/v1/chat/completions", 200), ("POST", "/v1/chat/completions", 200),
        ("POST", "/v1/chat/completions", 404), ("POST", "/v1/chat/completions", 401),
        ("POST", "/v1/embeddings", 200), ("GET", "/health", 200)]
    first, second, missing, refused, embedding, health = lines
    assert first["request_id"] == "req-1" and first["backend"] == whole.headers[
        "x-laneway-backend"]
    assert (first["model"], first["key"], first["policy"]) == ("fake", "alice", "round_robin")
    assert (first["prompt_tokens"], first["completion_tokens"]) == (2, 3)
    assert first["bytes"] == len(whole.content)
    assert 0 < first["first_byte_ms"] <= first["ms"]  # type: ignore[operator]
    assert second["completion_tokens"] == 5 and second["bytes"] == len(streamed.content)
    assert (missing["model"], missing["key"]) == ("nope", "alice")
    assert "backend" not in missing and "completion_tokens" not in missing
    # refused before its body is read (tests/security/test_review2_auth_first.py):
    # neither a model nor a key to log
    assert "model" not in refused and "key" not in refused
    assert (embedding["model"], embedding["key"]) == ("fake", "alice")
    assert embedding["backend"] in ("f0", "f1")
    assert health["client"] == "127.0.0.1"


async def test_no_line_when_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "laneway.access")
    async with fleet(FakeConfig()) as (proxy, _):
        assert (await post(proxy, CHAT)).status_code == 200
    assert access_lines(caplog) == []


def record(fields: dict[str, object] | None = None, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    entry = logging.LogRecord("laneway.access", logging.INFO, __file__, 1, "%s %s %d",
                              ("POST", "/v1/completions", 200), exc_info)
    if fields is not None:
        entry.fields = fields
    return entry


def test_formats() -> None:
    fields = {"method": "POST", "path": "/v1/completions", "status": 200, "ms": 1.5,
              "model": "a b", "key": ""}
    text = TextFormatter().format(record(fields))
    assert text.endswith('laneway.access: POST /v1/completions 200 ms=1.5 model="a b" key=""')
    assert TextFormatter().format(record()).endswith("POST /v1/completions 200")
    entry = orjson.loads(JsonFormatter().format(record(fields, exc=True)))
    assert entry["level"] == "info" and entry["logger"] == "laneway.access"
    assert entry["message"] == "POST /v1/completions 200" and entry["model"] == "a b"
    assert entry["time"].endswith("+00:00") and "ValueError: boom" in entry["exception"]


async def test_a_stream_the_client_left_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "laneway.access")
    async with fleet(FakeConfig(tpot_s=0.02), server={"access_log": True}) as (proxy, fakes):
        async with httpx.AsyncClient(base_url=proxy.url) as http, http.stream(
                "POST", "/v1/completions",
                json={"model": "fake", "prompt": "x", "max_tokens": 1000, "stream": True}
        ) as response:
            async for _ in response.aiter_lines():
                if fakes[0].app.stats.running:
                    break
        for _ in range(100):
            if access_lines(caplog):
                break
            await asyncio.sleep(0.02)
    (line,) = access_lines(caplog)
    assert line["status"] == 200 and line["client_left"] is True
    assert line["backend"] == "f0" and line.get("completion_tokens", 0) < 1000  # type: ignore[operator]


def test_a_traceback_cannot_forge_a_log_line() -> None:
    """(Second review: tracebacks were printed as they are, and an exception's message
    may carry client text.)"""
    forged = "2026-01-01 00:00:00,000 INFO laneway: forged"
    try:
        raise ValueError(f"bad model\n{forged}\x1b[31m")
    except ValueError:
        record = logging.LogRecord("laneway", logging.ERROR, __file__, 1, "failed", (),
                                   sys.exc_info())
    first, *rest = TextFormatter().format(record).splitlines()
    assert first.endswith("laneway: failed") and rest
    assert all(line.startswith("  ") for line in rest)  # no line of its own
    assert "\x1b" not in "".join(rest)
