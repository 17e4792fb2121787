"""`Upstream.open` against raw HTTP/1.1 answers that aiohttp's parser handles badly."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest

from proxy.config import UpstreamConfig
from proxy.relay.upstream import Upstream, UpstreamFailure
from proxy.types import Backend

EVENTS = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\ndata: [DONE]\n\n'


@asynccontextmanager
async def raw_backend(pause_s: float) -> AsyncIterator[str]:
    """Answers every request with a stream's headers, then (after `pause_s`, so they
    arrive apart) a first chunk whose size line is not hex, the events, the last
    chunk, and a close: as vLLM's answer broke in the real-vLLM backend fuzz."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"connection: close\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(pause_s)
        writer.write(b"zz\r\n" + EVENTS + b"\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


@pytest.mark.parametrize("pause_s", [0.0, 0.05])
async def test_a_stream_whose_first_chunk_size_is_not_hex_fails_in_time(pause_s: float) -> None:
    """aiohttp's C parser may stop on that chunk without an error, and its `sock_read`
    timeout does not fire then: the first read waited for ever. The proxy bounds it with
    `first_byte_timeout_s`, so the request is retried elsewhere."""
    async with raw_backend(pause_s) as url, aiohttp.ClientSession() as session:
        upstream = Upstream(session, UpstreamConfig(first_byte_timeout_s=0.5))
        started = time.monotonic()
        for _ in range(5):
            with pytest.raises(UpstreamFailure) as failed:
                async with asyncio.timeout(5):  # the test's own bound, not the proxy's
                    await upstream.open(Backend("b", url, "m"), "/v1/completions", b"{}",
                                        {"content-type": "application/json"}, stream=True)
            assert failed.value.kind in ("timeout", "broken")
        assert time.monotonic() - started < 5 * 0.5 + 2
