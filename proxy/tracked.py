"""The relay of a tracked request: one client stream over one or more backends.

Every upstream event is decoded (`Leg`), added to the `Generation`, and re-emitted
in the client's format. A migration trigger (a forced header, a policy's periodic
check, a drained backend) starts a `Handoff` while the source keeps streaming; a
source that fails mid-stream is continued elsewhere at once. Either way the client
sees one stream with no duplicate and no missing token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson

from predictors.base import NO_PREDICTION, Prediction
from proxy.asgi import Send, send_error
from proxy.emit import (
    DONE_EVENT,
    ResponseHead,
    comment_event,
    completion_body,
    pass_event,
    token_event,
    usage_event,
)
from proxy.errors import UpstreamError, stream_error_event
from proxy.generation import Generation
from proxy.handoff import Continuation, Handoff, HandoffFailed, open_continuation
from proxy.legs import Leg, LegFailed
from proxy.migration import Tracking, tokenizer_of
from proxy.pieces import Piece
from proxy.race import Race
from proxy.relay import UpstreamFailure
from proxy.runtime import Runtime
from proxy.types import Backend, Outcome, Progress, RequestContext

log = logging.getLogger("laneway.migration")


class TrackedRelay:
    def __init__(self, rt: Runtime, ctx: RequestContext, data: dict[str, Any],
                 tracking: Tracking, headers: dict[str, str], send: Send, *,
                 forced_after: int | None, announce: bool,
                 pred: Prediction = NO_PREDICTION) -> None:
        self.rt, self.ctx, self.tracking, self.send = rt, ctx, tracking, send
        self.pred = pred
        self.c = Continuation(rt, data, tracking, headers, ctx.model, ctx.endpoint == "chat")
        self.gen = Generation(tracking.stops, tracking.include_stop)
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
        self.done = False  # the last byte is being sent: a disconnect now changes nothing
        self._next_check = self.cfg.check_every_tokens
        self._read: asyncio.Future[list[Piece]] | None = None
        self._stash: list[Piece] = []  # source pieces past a forced splice point
        self._tokens_opened = False  # the first token event (it carries prompt ids) is out
        self._failure: LegFailed | None = None  # the source failed during a paced handoff

    # -- the loop ----------------------------------------------------------------
    async def run(self, leg: Leg) -> None:
        """Relay until the generation finishes. Raises UpstreamFailure if the first
        backend fails before its first event (nothing was sent: retry elsewhere)."""
        self.leg = leg
        self.gen.tokenizer = tokenizer_of(leg.backend)
        try:
            first = await leg.read()
        except LegFailed as exc:
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
                else:
                    await self._maybe_trigger()
            await self._finish()
        finally:
            self.rt.streams.untrack(self.leg.backend.name, self)

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

    async def _advance_handoff(self) -> None:
        """The warm-up finished (or the deadline passed) before the source's next read."""
        handoff = self.handoff
        assert handoff is not None
        try:
            handoff.finish_warm()
        except HandoffFailed as exc:
            self._handoff_failed(handoff, str(exc))
            return
        if handoff.ready and self.gen.clean_boundary:
            await self._continue_handoff()

    async def _continue_handoff(self) -> None:
        """Freeze the source where the client is and continue on the target."""
        handoff = self.handoff
        assert handoff is not None
        try:
            new_leg = await handoff.continue_at(self.gen)
        except HandoffFailed as exc:
            self._handoff_failed(handoff, str(exc))
            return
        await self._cut_over(new_leg, handoff.reason, handoff.started_at)

    # -- triggers ----------------------------------------------------------------
    def request_move(self, reason: str) -> None:
        self.move_requested = reason

    async def _maybe_trigger(self) -> None:
        if self.handoff is not None or self.migrations >= self.cfg.max_per_request:
            return
        if self.tracking.max_tokens is not None and \
                self.gen.generated >= self.tracking.max_tokens:
            return  # the backend is sending its last event
        reason, target = self._trigger()
        if reason is None:
            return
        target = target or self._pick_target(reason)
        if target is None:
            return
        self.migrations += 1
        log.info("request %s: moving %s -> %s after %d tokens (%s)", self.ctx.request_id,
                 self.leg.backend.name if self.leg else "-", target.name,
                 self.gen.generated, reason)
        if self._can_race(target) and await self._race(target, reason):
            return
        self._start_handoff(reason, target)
        if self.handoff is not None and self.handoff.ready and self.gen.clean_boundary:
            await self._continue_handoff()  # no warm-up: cut over right here

    def _trigger(self) -> tuple[str | None, Backend | None]:
        generated = self.gen.generated
        if self.forced_after is not None and generated >= self.forced_after:
            self.forced_after = None
            return "forced", None
        if self.move_requested is not None:
            reason, self.move_requested = self.move_requested, None
            return reason, None
        if self.rt.router.reroutes and generated >= self._next_check:
            self._next_check = generated + self.cfg.check_every_tokens
            pred = self.rt.predict_window(self.ctx, self.gen.text, generated)
            decision = self.rt.router.reroute(self.ctx, pred, self._progress(), self._view())
            if decision is not None:
                return "policy", decision.backend
        return None, None

    def _progress(self) -> Progress:
        assert self.leg is not None
        ttft = None if self.first_token_at is None else self.first_token_at - self.ctx.arrived_at
        return Progress(
            backend=self.leg.backend, generated=self.gen.generated,
            max_tokens=self.tracking.max_tokens, elapsed_s=time.monotonic() - self.ctx.arrived_at,
            ttft_s=ttft, tpot_s=self.leg.tpot(), migrations=self.migrations)

    def _view(self, exclude: tuple[str, ...] = ()) -> Any:
        assert self.leg is not None
        return self.rt.registry.view(
            self.ctx.model, time.monotonic(), exclude=(self.leg.backend.name, *exclude))

    def _pick_target(self, reason: str) -> Backend | None:
        view = self._view()
        if not view.candidates:
            log.info("request %s: no backend to move to (%s)", self.ctx.request_id, reason)
            return None
        return self.rt.router.pick(self.ctx, self.pred, view).backend

    def _start_handoff(self, reason: str, target: Backend) -> None:
        self.handoff = Handoff.start(self.c, self.gen, target, reason,
                                     warm=self.cfg.warm_prefill)

    def _can_race(self, target: Backend) -> bool:
        return (self.tracking.greedy and self.cfg.pace_slowdown > 0
                and tokenizer_of(target) == self.gen.tokenizer
                and self.gen.prompt_token_ids is not None)

    async def _race(self, target: Backend, reason: str) -> bool:
        """The paced handoff (proxy/race.py); False if it must fall back to freezing."""
        assert self.leg is not None
        started = time.monotonic()
        held, self._stash = self._stash, []
        race = Race(self.c, self.gen, self.leg, target, self.cfg.pace_slowdown,
                    self.cfg.pace_default_tpot_s, started + self.cfg.pace_timeout_s, held)
        read, self._read = self._read, None
        try:
            end = await race.run(self._emit, read)
            if end.kind != "cut":
                await race.flush(self._emit)
        finally:
            race.close()
        if end.kind == "cut":
            assert end.leg is not None
            await self._cut_over(end.leg, reason, started, race.start)
            self._read = end.next_read
            await self._emit(list(end.ahead))
            return True
        self._observe_leg(target.name, started, ok=end.kind == "done", tokens=0)
        if end.kind == "failed":
            self._failure = end.error  # the main loop fails over
            return True
        if end.kind == "done":
            log.info("request %s: finished on %s before %s caught up", self.ctx.request_id,
                     self.leg.backend.name, target.name)
        if end.kind == "abandoned":
            log.info("request %s: paced handoff to %s abandoned (%s); freezing instead",
                     self.ctx.request_id, target.name, end.detail)
            return self.gen.finished
        return True

    def _handoff_failed(self, handoff: Handoff, detail: str) -> None:
        assert self.leg is not None
        log.warning("request %s: move %s -> %s failed, staying (%s)", self.ctx.request_id,
                    self.leg.backend.name, handoff.target.name, detail)
        self.rt.metrics.migration_failures.labels(handoff.reason, handoff.target.name).inc()
        self._observe_leg(handoff.target.name, handoff.started_at, ok=False, tokens=0)
        handoff.close()
        self.handoff = None

    # -- failure -----------------------------------------------------------------
    async def _fail_over(self, exc: LegFailed) -> bool:
        """Continue on another backend after the current one failed mid-stream."""
        leg = self.leg
        assert leg is not None
        self.rt.upstream_failed(UpstreamFailure(leg.backend, exc.kind, exc.detail),
                                self.ctx.model)
        if self.handoff is not None:
            self.handoff.close()
            self.handoff = None
        if self._read is not None:
            self._read.cancel()
            self._read = None
        if not self.cfg.on_failure or self.migrations >= self.cfg.max_per_request \
                or self.gen.prompt_token_ids is None:
            return False
        started = time.monotonic()
        tried: list[str] = []
        for _ in range(self.rt.settings.upstream.max_attempts):
            view = self._view(tuple(tried))
            if not view.candidates:
                break
            target = self.rt.router.pick(self.ctx, self.pred, view).backend
            tried.append(target.name)
            try:
                new_leg = await open_continuation(self.c, self.gen, target)
            except HandoffFailed as failed:
                self._observe_leg(target.name, started, ok=False, tokens=0)
                log.warning("request %s: failover to %s failed: %s", self.ctx.request_id,
                            target.name, failed)
                continue
            self.migrations += 1
            await self._cut_over(new_leg, "failure", started)
            return True
        return False

    async def _fail(self, exc: LegFailed) -> None:
        assert self.leg is not None
        self.failed = True
        self.done = True
        err = UpstreamError(f"Backend {self.leg.backend.name} failed mid-stream "
                            f"({exc.kind}: {exc.detail}); the response is incomplete.")
        if not self.tracking.client_streams:
            await send_error(self.send, err)
            return
        await self._start_stream()
        await self.send({"type": "http.response.body", "body": stream_error_event(err),
                         "more_body": False})

    # -- cut-over ----------------------------------------------------------------
    async def _cut_over(self, new_leg: Leg, reason: str, started_at: float,
                        continued_from: int | None = None) -> None:
        """Switch to `new_leg`. `continued_from`: the position its continuation starts
        at when that is before what the client has (a paced handoff)."""
        old = self.leg
        assert old is not None
        if self._read is not None:
            self._read.cancel()  # pieces past the splice are regenerated by the target
            self._read = None
        self._stash = []  # past the splice: the target generates these again
        if new_leg.rebase is not None:
            self.gen.rebase(*new_leg.rebase)
        at_token = self.gen.generated
        self._observe_leg(old.backend.name, old.started_at, ok=True, tokens=old.tokens,
                          moved_to=new_leg.backend.name)
        old.close()
        self.rt.streams.untrack(old.backend.name, self)
        self.rt.streams.track(new_leg.backend.name, self)
        self.leg, self.handoff = new_leg, None
        self.stall_from = self.last_emit_at or None
        self.rt.metrics.migrations.labels(reason, old.backend.name, new_leg.backend.name).inc()
        prompt = len(self.gen.prompt_token_ids or ())
        self.rt.metrics.reprefilled.labels(new_leg.backend.name).inc(prompt + at_token)
        log.info("request %s: now on %s at token %d (%s, handoff %.1f ms)",
                 self.ctx.request_id, new_leg.backend.name, at_token, reason,
                 (time.monotonic() - started_at) * 1000)
        if self.announce and self.started:
            await self._send(comment_event({
                "event": "migrated", "from": old.backend.name, "to": new_leg.backend.name,
                "at_token": at_token, "reason": reason,
                "continued_from": at_token if continued_from is None else continued_from}))

    # -- output ------------------------------------------------------------------
    async def _emit(self, pieces: list[Piece]) -> None:
        """Add `pieces` to the generation; send what they release in one write."""
        out: list[bytes] = []
        first = self.first_token_at is None
        for at, piece in enumerate(pieces):
            if self._forced_due() and at:
                self._stash = pieces[at:]  # splice exactly where the header asked
                break
            if self.head is None:
                self.head = self._response_head(piece)
            release = self.gen.add(piece)
            if self._is_role_event(piece):
                if not self.started and not out:
                    assert piece.event is not None
                    out.append(pass_event(piece.event, self.head))
                continue
            if release.text or release.token_ids or release.finish_reason:
                opening, self._tokens_opened = not self._tokens_opened, True
                out.append(token_event(
                    self.head, release.text, release.token_ids,
                    finish_reason=release.finish_reason, stop_reason=release.stop_reason,
                    prompt_token_ids=self.gen.prompt_token_ids if opening else None,
                    fingerprint=self.gen.fingerprint if release.finish_reason else None))
            if self.gen.finished:
                break
        if not self.tracking.client_streams:
            if self.first_token_at is None and self.gen.generated:
                self.first_token_at = time.monotonic()
            return
        if not out:
            return
        await self._start_stream()
        await self._send(b"".join(out))
        if self.gen.generated:
            self._token_sent(first)

    def _forced_due(self) -> bool:
        return self.forced_after is not None and self.gen.generated >= self.forced_after \
            and self.handoff is None and self.migrations < self.cfg.max_per_request

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
        return ResponseHead(
            id=str(event.get("id", self.ctx.request_id)), created=int(event.get("created", 0)),
            model=str(event.get("model", self.ctx.model)), chat=self.ctx.endpoint == "chat",
            with_token_ids=self.tracking.with_token_ids)

    async def _start_stream(self) -> None:
        if self.started:
            return
        self.started = True
        assert self.leg is not None
        await self.send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", self.leg.opened.content_type),
            (b"x-laneway-backend", self.leg.backend.name.encode()),
            (b"x-request-id", self.ctx.request_id.encode()),
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
                if self.tracking.include_usage else b""
            await self.send({"type": "http.response.body", "body": tail + DONE_EVENT,
                             "more_body": False})
            return
        body = orjson.dumps(completion_body(
            head, "".join(gen.text_parts), gen.token_ids, gen.prompt_token_ids,
            gen.finish_reason, gen.stop_reason, gen.fingerprint))
        await self.send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-laneway-backend", self.leg.backend.name.encode()),
            (b"x-request-id", self.ctx.request_id.encode()),
        ]})
        self.started = True
        await self.send({"type": "http.response.body", "body": body})

    # -- accounting --------------------------------------------------------------
    def _observe_leg(self, backend: str, started_at: float, *, ok: bool, tokens: int,
                     moved_to: str | None = None) -> None:
        self.rt.router.observe(Outcome(
            request_id=self.ctx.request_id, model=self.ctx.model, backend=backend,
            policy=self.rt.router.policy_name, status=200 if ok else 502, ok=ok,
            started_at=started_at, ttft_s=None, e2e_s=time.monotonic() - started_at,
            completion_tokens=tokens, moved_to=moved_to, migrations=self.migrations))

    def final_outcome(self, client_gone: bool) -> Outcome:
        """The request's outcome, on the backend it ended on."""
        ctx, gen, leg = self.ctx, self.gen, self.leg
        assert leg is not None
        status = 499 if client_gone else (502 if self.failed else 200)
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
