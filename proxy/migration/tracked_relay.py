"""The relay of a tracked request: one client stream over one or more backends.

Every upstream event is decoded (`Leg`), added to the `Generation`, and re-emitted
in the client's format. A migration trigger (a forced header, a policy's periodic
check, a drained backend) starts a `Handoff` while the source keeps streaming; a
source that fails mid-stream is continued elsewhere at once. Either way the client
sees one stream with no duplicate and no missing token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import orjson

from proxy.asgi import Send, send_bytes, send_error
from proxy.errors import mid_stream_failure, stream_error_event
from proxy.migration.client_emit import (
    DONE_EVENT,
    ResponseHead,
    completion_body,
    pass_event,
    token_event,
    usage_event,
)
from proxy.migration.eligibility import Tracking, tokenizer_of
from proxy.migration.event_pieces import Piece
from proxy.migration.generation import Generation
from proxy.migration.handoff import Continuation, Handoff
from proxy.migration.legs import Leg, LegFailed
from proxy.migration.moves import Moves
from proxy.relay.upstream import UpstreamFailure
from proxy.runtime import Runtime
from proxy.types import NO_PREDICTION, Outcome, Prediction, RequestContext

log = logging.getLogger("laneway.migration")
_USAGE_EVENT_WAIT_S = 0.5  # for the event that follows a stream's last token


class TrackedRelay(Moves):
    def __init__(self, rt: Runtime, ctx: RequestContext, data: dict[str, Any],
                 tracking: Tracking, headers: dict[str, str], send: Send, *,
                 forced_after: int | None, announce: bool,
                 pred: Prediction = NO_PREDICTION) -> None:
        self.rt, self.ctx, self.tracking, self.send = rt, ctx, tracking, send
        self.pred = pred
        self.c = Continuation(rt, data, tracking, headers, ctx.model, ctx.endpoint == "chat",
                              ctx.slo_class, ctx.arrived_at)
        self.gen = Generation(tracking.stops, tracking.include_stop,
                              min_tokens=tracking.min_tokens)
        self.forced_after = forced_after
        self.announce = announce and tracking.client_streams
        self.cfg = rt.settings.migration
        self.migrations = 0
        self.move_requested: str | None = None  # set from outside (a drain)
        self.leg: Leg | None = None
        self.handoff: Handoff | None = None
        self.head: ResponseHead | None = None
        self.started = False  # response headers sent
        self.first_token_at: float | None = None
        self.last_emit_at = 0.0
        self.stall_from: float | None = None  # set at a cut-over, until the next token
        self.failed = False
        # the status of a backend's refusal (proxy/migration/legs.py)
        self.refused: int | None = None
        self.done = False  # the last byte is being sent: a disconnect now changes nothing
        self._next_check = self.cfg.check_every_tokens
        self._read: asyncio.Future[list[Piece]] | None = None
        self._stash: list[Piece] = []  # source pieces past a forced splice point
        self._tokens_opened = False  # the first token event (it carries prompt ids) is out
        self._failure: LegFailed | None = None  # the source failed during a paced handoff
        # The backend's reasoning deltas (a server with a reasoning parser). Once there
        # are any, the stream stays where it is: a continuation is a raw completion,
        # which would come back without the parser's split into reasoning and content.
        self.reasoning_parts: list[str] = []
        # The server puts usage in every chunk unasked (`--enable-force-include-usage`):
        # so do the proxy's events, and a usage event ends the stream.
        self.usage_in_chunks = False

    # -- the loop ----------------------------------------------------------------
    async def run(self, leg: Leg) -> None:
        """Relay until the generation finishes. Raises UpstreamFailure if the first
        backend fails before its first event (nothing was sent: retry elsewhere)."""
        self.leg = leg
        self.gen.tokenizer = tokenizer_of(leg.backend)
        try:
            first = await leg.read()
        except LegFailed as exc:
            if exc.refusal is not None:  # the client's error: no other backend tried
                await self._fail(exc)
                return
            leg.opened.fail(exc.kind, exc.detail)
            raise UpstreamFailure(leg.backend, exc.kind, exc.detail) from None
        self.rt.streams.track(leg.backend.name, self)
        try:
            await self._emit(first)
            if not self.gen.finished:
                await self._maybe_trigger()
            while not self.gen.finished:
                try:
                    pieces = await self._next_pieces()
                except LegFailed as exc:
                    if await self._fail_over(exc):
                        continue
                    await self._fail(exc)
                    return
                if not pieces:  # [DONE] without a finish_reason
                    await self._fail(LegFailed("broken", "stream ended unfinished"))
                    return
                await self._emit(pieces)
                if self.gen.finished:
                    break
                if self.handoff is not None and self.handoff.ready and self.gen.clean_boundary:
                    await self._continue_handoff()
                elif self._trigger_due():
                    await self._maybe_trigger()
            if self.handoff is not None:
                self._drop_outrun_handoff()
            if self.usage_in_chunks and self.gen.fingerprint is None:
                await self._read_usage_event()
            await self._finish()
        finally:
            self.rt.streams.untrack(self.leg.backend.name, self)

    def _drop_outrun_handoff(self) -> None:
        """The source finished before the target was ready: the move is dropped, and its
        slot and warm-up on the target are released before the client's last write."""
        handoff, leg = self.handoff, self.leg
        assert handoff is not None and leg is not None
        log.info("request %s: finished on %s before %s was ready; move dropped (%s, %.1f ms)",
                 self.ctx.request_id, leg.backend.name, handoff.target.name, handoff.reason,
                 (time.monotonic() - handoff.started_at) * 1000)
        handoff.close()
        self.handoff = None

    def _fingerprint_from(self, pieces: list[Piece]) -> None:
        """The fingerprint of the events after the last token (the usage event)."""
        for piece in pieces:
            self.gen.fingerprint = piece.fingerprint or self.gen.fingerprint

    async def _read_usage_event(self) -> None:
        """A server that puts usage in every chunk puts its fingerprint on the usage
        event after the last token only: read it, if it comes at once."""
        assert self.leg is not None
        if self._read is not None or self._stash:
            return
        with contextlib.suppress(LegFailed, TimeoutError):
            async with asyncio.timeout(_USAGE_EVENT_WAIT_S):
                self._fingerprint_from(await self.leg.read())

    async def _next_pieces(self) -> list[Piece]:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        if self._stash:  # held back at a forced splice whose handoff did not happen
            pieces, self._stash = self._stash, []
            return pieces
        while True:
            assert self.leg is not None
            if self.handoff is None:
                if self._read is None:
                    return await self.leg.read()  # the common case: no handoff running
                read, self._read = self._read, None
                return await read
            if self._read is None:
                self._read = asyncio.ensure_future(self.leg.read())
            await self.handoff.wait_either(self._read)
            if self._read.done():
                read, self._read = self._read, None
                return read.result()
            await self._advance_handoff()

    async def _fail(self, exc: LegFailed) -> None:
        assert self.leg is not None
        self.done = True
        if exc.refusal is not None:
            await self._refuse(*exc.refusal)
            return
        self.failed = True
        log.warning("%s: the stream failed (%s): %s", self.leg.backend.name, exc.kind,
                    exc.detail)
        err = mid_stream_failure(self.leg.backend.name, exc.kind)
        if not self.tracking.client_streams:
            await send_error(self.send, err)
            return
        await self._start_stream()
        await self.send({"type": "http.response.body", "body": stream_error_event(err),
                         "more_body": False})

    async def _refuse(self, status: int, payload: bytes) -> None:
        """The backend refused the request in its stream (a 4xx error event, e.g. a
        token id out of its vocabulary): answered as it put it, in the stream as vLLM
        does, or for a whole answer with the event's status and body."""
        assert self.leg is not None
        log.info("request %s: %s refused it (%d): %s", self.ctx.request_id,
                 self.leg.backend.name, status, payload[:300].decode(errors="replace"))
        self.refused = status
        if not self.tracking.client_streams:
            await send_bytes(self.send, status, payload, [
                (b"content-type", b"application/json"),
                (b"x-laneway-backend", self.leg.backend.name.encode()),
                (b"x-request-id", self.ctx.echo_id.encode())])
            return
        await self._start_stream()
        await self.send({"type": "http.response.body", "more_body": False,
                         "body": b"data: " + payload + b"\n\ndata: [DONE]\n\n"})

    # -- output ------------------------------------------------------------------
    async def _emit(self, pieces: list[Piece]) -> None:
        """Add `pieces` to the generation; send what they release in one write."""
        out: list[bytes] = []
        first = self.first_token_at is None
        for at, piece in enumerate(pieces):
            if at and self._forced_due():
                self._stash = pieces[at:]  # splice exactly where the header asked
                break
            if self.head is None:
                self.head = self._response_head(piece)
            if piece.usage is not None and not self.usage_in_chunks \
                    and self.tracking.client_streams and piece.event is not None \
                    and piece.event.get("choices") and not self.migrations:
                self.usage_in_chunks = True  # (as the server the stream started on)
            release = self.gen.add(piece)
            if piece.reasoning:
                self._reasoned(piece.reasoning)
            if not piece.token_ids and self._is_role_event(piece):
                if not self.started and not out:
                    assert piece.event is not None
                    out.append(pass_event(piece.event, self.head))
                continue
            if release.text or release.token_ids or release.finish_reason or piece.reasoning:
                opening, self._tokens_opened = not self._tokens_opened, True
                out.append(token_event(
                    self.head, release.text, release.token_ids,
                    finish_reason=release.finish_reason, stop_reason=release.stop_reason,
                    prompt_token_ids=self.gen.prompt_token_ids if opening else None,
                    # as vLLM: on the last token event, unless a usage event follows
                    fingerprint=self.gen.fingerprint if release.finish_reason
                    and not self._usage_event else None,
                    reasoning=piece.reasoning,
                    usage=(len(self.gen.prompt_token_ids or ()), self.gen.generated)
                    if self.usage_in_chunks else None))
            if self.gen.finished:
                self._fingerprint_from(pieces[at + 1:])
                break
        if not self.tracking.client_streams:
            if self.first_token_at is None and self.gen.generated:
                self.first_token_at = time.monotonic()
            return
        if not out:
            return
        if not self.started:
            await self._start_stream()
        await self.send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
        if self.gen.generated:
            self._token_sent(first)

    @property
    def _usage_event(self) -> bool:
        """Whether the stream ends with a usage event (asked for, or forced)."""
        return self.tracking.include_usage or self.usage_in_chunks

    def _reasoned(self, text: str) -> None:
        if not self.reasoning_parts:
            assert self.leg is not None
            log.info("request %s: %s streams reasoning; the stream stays there",
                     self.ctx.request_id, self.leg.backend.name)
            self.rt.streams.reasoning.add(self.leg.backend.name)
            if self.handoff is not None:  # a frozen handoff started before: dropped
                self.handoff.close()
                self.handoff = None
        self.reasoning_parts.append(text)

    def _forced_due(self) -> bool:
        return self.forced_after is not None and self.gen.generated >= self.forced_after \
            and self.handoff is None and self.migrations < self.cfg.max_per_request \
            and not self._stays()

    def _token_sent(self, first: bool) -> None:
        now = time.monotonic()
        if first:
            self.first_token_at = now
        if self.stall_from is not None:
            self.rt.metrics.handoff_stall.observe(now - self.stall_from)
            self.stall_from = None
        self.last_emit_at = now

    def _is_role_event(self, piece: Piece) -> bool:
        assert self.leg is not None
        return (self.leg.chat and not piece.token_ids and not piece.text
                and piece.finish_reason is None and piece.event is not None
                and bool(piece.event.get("choices"))
                and "role" in (piece.event["choices"][0].get("delta") or {}))

    def _response_head(self, piece: Piece) -> ResponseHead:
        event = piece.event or {}
        prompt_text = event.get("prompt_text")
        return ResponseHead(
            id=str(event.get("id", self.ctx.request_id)), created=int(event.get("created", 0)),
            model=str(event.get("model", self.ctx.model)), chat=self.ctx.endpoint == "chat",
            with_token_ids=self.tracking.with_token_ids,
            prompt_text=prompt_text if isinstance(prompt_text, str) else None)

    async def _start_stream(self) -> None:
        if self.started:
            return
        self.started = True
        assert self.leg is not None
        await self.send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", self.leg.opened.content_type),
            (b"x-laneway-backend", self.leg.backend.name.encode()),
            (b"x-request-id", self.ctx.echo_id.encode()),
        ]})

    async def _send(self, body: bytes) -> None:
        await self.send({"type": "http.response.body", "body": body, "more_body": True})

    async def _finish(self) -> None:
        gen, head = self.gen, self.head
        assert head is not None and self.leg is not None
        prompt_tokens = len(gen.prompt_token_ids or ())
        self.done = True
        if self.tracking.client_streams:
            tail = usage_event(head, prompt_tokens, gen.generated, gen.fingerprint) \
                if self._usage_event else b""
            await self.send({"type": "http.response.body", "body": tail + DONE_EVENT,
                             "more_body": False})
            return
        body = orjson.dumps(completion_body(
            head, "".join(gen.text_parts), gen.token_ids, gen.prompt_token_ids,
            gen.finish_reason, gen.stop_reason, gen.fingerprint,
            "".join(self.reasoning_parts) if self.reasoning_parts else None))
        await self.send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-laneway-backend", self.leg.backend.name.encode()),
            (b"x-request-id", self.ctx.echo_id.encode()),
        ]})
        self.started = True
        await self.send({"type": "http.response.body", "body": body})

    # -- accounting --------------------------------------------------------------
    def final_outcome(self, client_gone: bool) -> Outcome:
        """The request's outcome, on the backend it ended on."""
        ctx, gen, leg = self.ctx, self.gen, self.leg
        assert leg is not None
        status = 499 if client_gone else self.refused or (502 if self.failed else 200)
        ttft = None if self.first_token_at is None else self.first_token_at - ctx.arrived_at
        tpot = None
        if self.first_token_at is not None and gen.generated > 1 and self.last_emit_at:
            tpot = (self.last_emit_at - self.first_token_at) / (gen.generated - 1)
        return Outcome(
            request_id=ctx.request_id, model=ctx.model, backend=leg.backend.name,
            policy=self.rt.router.policy_name, status=status, ok=status == 200,
            started_at=ctx.arrived_at, ttft_s=ttft, e2e_s=time.monotonic() - ctx.arrived_at,
            completion_tokens=gen.generated, prompt_tokens=len(gen.prompt_token_ids or ()),
            tpot_s=tpot, migrations=self.migrations)

    def close(self) -> None:
        if self._read is not None:
            self._read.cancel()
        if self.handoff is not None:
            self.handoff.close()
        if self.leg is not None:
            self.leg.close()
