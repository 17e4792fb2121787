"""A backend that misbehaves as it is told: a fake vLLM's answers, broken on the way.

`Saboteur` serves raw HTTP/1.1 from asyncio streams (so it can also break the framing)
in front of a fake vLLM. Every request but a generation or an embedding (scrapes,
/v1/models, the migration's /tokenize) is relayed to the fake unchanged. Those get the
fake's answer with `plan` applied: another status; its events re-chunked, with comments
between them, CRLF line ends or junk after `[DONE]` (all harmless to a correct reader);
and at most one `Disruption`: the connection cut or left silent at a byte, an event the
relay cannot use, vLLM's in-stream 400 refusal, a lying `content-length`, a broken
chunk size, or a last event left without its blank line.
tests/proxy/test_fuzz_upstream.py states what the client must get for each.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import orjson

from bench.fakes.fake_vllm import REFUSAL

GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
              "/v1/embeddings")
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}
_STALL_CAP_S = 10.0  # a silent answer waits this long at most for the proxy to leave


@dataclass(frozen=True)
class Disruption:
    """`kind`, where it happens (`at`: an event's index for events, a fraction of the
    body for bytes), and its bytes for `garbage`:
    cut | stall (bytes), garbage | refusal (an event inserted before event `at`),
    truncate (event `at`'s payload cut to `keep` bytes), short | long (`content-length`
    `keep` bytes off the body's), badchunk (a chunk size that is not hex at `at`),
    unended (the body ends cleanly, but its last event without the blank line that ends
    it)."""

    kind: str
    at: float = 0.0
    keep: int = 0
    junk: bytes = b""


@dataclass(frozen=True)
class Plan:
    status: int | None = None  # another status, with an OpenAI error body
    cuts: tuple[float, ...] = ()  # where the body is split into writes (fractions)
    comments: bool = False  # ": ping" comment events between the events
    crlf: bool = False  # "\r\n" line ends
    after_done: bytes = b""  # an event after "[DONE]"
    chunked: bool = True  # else delimited by closing (or content-length for short|long)
    disruption: Disruption | None = None


@dataclass
class Saboteur:
    upstream: str  # the fake vLLM's URL
    plan: Plan | None = None  # applied to every generation request until changed
    hits: int = 0  # generation requests that arrived under a plan
    refusals: int = 0  # ... of them with a refusal before the event that finishes
    url: str = ""
    _http: aiohttp.ClientSession | None = field(default=None, repr=False)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[Saboteur]:
        server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as self._http, server:
            yield self
            server.close()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError,
                                 asyncio.LimitOverrunError):
            try:
                while await self._one(reader, writer):
                    pass
            finally:
                writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; whether the connection stays open for another."""
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, *lines = head.decode("latin-1").split("\r\n")
        method, path, _ = request_line.split(" ", 2)
        headers = dict(line.split(": ", 1) for line in lines if ": " in line)
        length = int(next((v for k, v in headers.items()
                           if k.lower() == "content-length"), "0"))
        body = await reader.readexactly(length)
        # the plan in force when the request arrived: the caller may give up on it (a
        # slow upstream) and change the plan before the upstream has answered
        plan = self.plan if path.split("?")[0] in GENERATION else None
        if plan is not None:
            self.hits += 1
        assert self._http is not None
        async with self._http.request(
                method, self.upstream + path, data=body,
                headers={k: v for k, v in headers.items() if k.lower() not in _HOP}) as got:
            status, payload = got.status, await got.read()
            content_type = got.headers.get("content-type", "application/json")
        if plan is None:
            writer.write(b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                         % (status, content_type.encode(), len(payload), payload))
            await writer.drain()
            return True
        await self._sabotage(reader, writer, plan, status, content_type, payload)
        return False

    async def _sabotage(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        plan: Plan, status: int, content_type: str, payload: bytes) -> None:
        if plan.status is not None:
            status, content_type = plan.status, "application/json"
            payload = orjson.dumps({"error": {"message": "sabotaged", "type": "Error",
                                              "param": None, "code": plan.status}})
        elif content_type.startswith("text/event-stream"):
            payload, refused = rewrite_events(payload, plan)
            self.refusals += refused
        cut = plan.disruption
        if cut is not None and cut.kind == "unended":
            payload = payload.rstrip(b"\r\n")
        lying = cut is not None and cut.kind in ("short", "long")
        chunked = plan.chunked and not lying
        framing = b"transfer-encoding: chunked\r\n" if chunked else b""
        if cut is not None and lying:
            declared = len(payload) + (cut.keep if cut.kind == "long" else -cut.keep)
            framing = b"content-length: %d\r\n" % max(0, declared)
        writer.write(b"HTTP/1.1 %d X\r\ncontent-type: %s\r\nconnection: close\r\n%s\r\n"
                     % (status, content_type.encode(), framing))
        end = len(payload)
        if cut is not None and cut.kind in ("cut", "stall"):
            end = int(cut.at * len(payload))
        bounds = sorted({0, end, *(int(c * end) for c in plan.cuts)})
        for at, (start, stop) in enumerate(itertools.pairwise(bounds)):
            piece = payload[start:stop]
            if chunked:
                broken = cut is not None and cut.kind == "badchunk" \
                    and at == int(cut.at * (len(bounds) - 1))
                piece = (b"zz" if broken else b"%x" % len(piece)) + b"\r\n" + piece + b"\r\n"
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0)
        if cut is not None and cut.kind == "stall":
            with contextlib.suppress(TimeoutError):  # until the proxy gives up on it
                async with asyncio.timeout(_STALL_CAP_S):
                    await reader.read()
            return
        if chunked and end == len(payload):
            writer.write(b"0\r\n\r\n")
        await writer.drain()


def rewrite_events(payload: bytes, plan: Plan) -> tuple[bytes, bool]:
    """The SSE body with the plan's event changes (and its event disruption), and
    whether it has a refusal before the event that finishes the generation."""
    events = [e for e in payload.split(b"\n\n") if e]
    cut, refused = plan.disruption, False
    if cut is not None and events:
        at = int(cut.at) % len(events)
        if cut.kind == "garbage":
            events.insert(at, b"data: " + cut.junk)
        elif cut.kind == "refusal":
            refused = not any(_finishes(event) for event in events[:at])
            events.insert(at, b"data: " + REFUSAL)
        elif cut.kind == "truncate" and events[at] != b"data: [DONE]":
            events[at] = events[at][:6 + cut.keep % max(1, len(events[at]) - 6)]
    if plan.after_done:
        events.append(b"data: " + plan.after_done)
    if plan.comments:
        events = [e for event in events for e in (b": ping", event)]
    body = b"".join(e + b"\n\n" for e in events)
    return body.replace(b"\n", b"\r\n") if plan.crlf else body, refused


def _finishes(event: bytes) -> bool:
    if not event.startswith(b"data: {"):
        return False
    choices = orjson.loads(event[6:]).get("choices") or ()
    return any(choice.get("finish_reason") for choice in choices)
