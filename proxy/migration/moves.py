"""How a tracked stream moves: triggers, the paced and frozen handoffs, failover,
and the cut-over itself. `TrackedRelay` (proxy/migration/tracked_relay.py) is the loop around it.

Triggers (issue: migration): a forced header after N tokens, a drain of the backend,
a rerouting policy asked every `migration.check_every_tokens` tokens, and the source
failing mid-stream. Greedy streams move by the paced handoff (proxy/migration/paced_handoff.py);
others,
and greedy ones whose race is abandoned, by the frozen handoff (proxy/migration/handoff.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from proxy.asgi import Send
from proxy.config import MigrationConfig
from proxy.migration.client_emit import comment_event
from proxy.migration.eligibility import Tracking, tokenizer_of
from proxy.migration.event_pieces import Piece
from proxy.migration.generation import Generation
from proxy.migration.handoff import Continuation, Handoff, HandoffFailed, open_continuation
from proxy.migration.legs import Leg, LegFailed
from proxy.migration.paced_handoff import Race
from proxy.relay.upstream import UpstreamFailure
from proxy.runtime import Runtime
from proxy.types import Backend, ClusterView, Outcome, Prediction, Progress, RequestContext

log = logging.getLogger("laneway.migration")


class Moves:
    """The moving half of a tracked relay (state is set up by `TrackedRelay`)."""

    rt: Runtime
    ctx: RequestContext
    tracking: Tracking
    send: Send
    c: Continuation
    cfg: MigrationConfig
    gen: Generation
    pred: Prediction
    leg: Leg | None
    handoff: Handoff | None
    migrations: int
    move_requested: str | None
    forced_after: int | None
    announce: bool
    started: bool
    first_token_at: float | None
    last_emit_at: float
    stall_from: float | None
    _next_check: int
    _read: asyncio.Future[list[Piece]] | None
    _stash: list[Piece]
    _failure: LegFailed | None
    reasoning_parts: list[str]

    async def _emit(self, pieces: list[Piece]) -> None:
        raise NotImplementedError

    async def _send(self, body: bytes) -> None:
        raise NotImplementedError

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
        if self.handoff is not None or self.migrations >= self.cfg.max_per_request \
                or self._stays():
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
        if self.reasoning_parts:
            return  # the race ended at the source's first reasoning delta
        self._start_handoff(reason, target)
        if self.handoff is not None and self.handoff.ready and self.gen.clean_boundary:
            await self._continue_handoff()  # no warm-up: cut over right here

    def _stays(self) -> bool:
        """A reasoning stream, or one on a backend that streamed reasoning before, does
        not move (proxy/migration/tracked_relay.py: `reasoning_parts`)."""
        return bool(self.reasoning_parts) or (
            self.leg is not None and self.leg.backend.name in self.rt.streams.reasoning)

    def _trigger_due(self) -> bool:
        """Whether `_trigger` may find a move due (its conditions, loosely): checked on
        every chunk, so without awaiting anything. A trigger added there goes here too."""
        return (self.forced_after is not None or self.move_requested is not None
                or (self.gen.generated >= self._next_check and self.rt.router.reroutes))

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
            view = self.rt.flow.for_move(self._view(), required=False)
            if not view.candidates:
                return None, None  # every other backend is full: stay until the next check
            pred = self.rt.predict_window(self.ctx, self.gen.text, generated)
            decision = self.rt.router.reroute(self.ctx, pred, self._progress(), view)
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

    def _view(self, exclude: tuple[str, ...] = ()) -> ClusterView:
        assert self.leg is not None
        return self.rt.registry.view(
            self.ctx.model, time.monotonic(), exclude=(self.leg.backend.name, *exclude))

    def _pick_target(self, reason: str) -> Backend | None:
        view = self.rt.flow.for_move(self._view(), required=True)
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
        """The paced handoff (proxy/migration/paced_handoff.py); False if it must fall back to
        freezing."""
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
            log.info("request %s: %s caught up; %s", self.ctx.request_id, target.name,
                     race.describe())
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
            log.info("request %s: paced handoff to %s abandoned (%s)%s", self.ctx.request_id,
                     target.name, end.detail, "" if self.reasoning_parts else
                     "; freezing instead")
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
        leg.opened.fail(exc.kind, exc.detail)
        if exc.refusal is None:  # a refusal is the client's error, not the backend's
            self.rt.upstream_failed(UpstreamFailure(leg.backend, exc.kind, exc.detail),
                                    self.ctx.model)
        if self.handoff is not None:
            self.handoff.close()
            self.handoff = None
        if self._read is not None:
            self._read.cancel()
            self._read = None
        if not self.cfg.on_failure or self.migrations >= self.cfg.max_per_request \
                or self.gen.prompt_token_ids is None or exc.refusal is not None:
            return False  # (another backend would refuse it too)
        if self.reasoning_parts:
            log.warning("request %s: %s failed mid-reasoning; a continuation elsewhere "
                        "would lose the reasoning split, so the stream ends here",
                        self.ctx.request_id, leg.backend.name)
            return False
        started = time.monotonic()
        tried: list[str] = []
        for _ in range(self.rt.settings.upstream.max_attempts):
            view = self.rt.flow.for_move(self._view(tuple(tried)), required=True)
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
        continued_from = (at_token if continued_from is None else continued_from) \
            - new_leg.replayed
        log.info("request %s: now on %s at token %d (%s, handoff %.1f ms%s)",
                 self.ctx.request_id, new_leg.backend.name, at_token, reason,
                 (time.monotonic() - started_at) * 1000,
                 f"; continued from token {continued_from}, where the text decodes "
                 "completely" if new_leg.replayed else "")
        if self.announce and self.started:
            await self._send(comment_event({
                "event": "migrated", "from": old.backend.name, "to": new_leg.backend.name,
                "at_token": at_token, "reason": reason, "continued_from": continued_from}))


    def _observe_leg(self, backend: str, started_at: float, *, ok: bool, tokens: int,
                     moved_to: str | None = None) -> None:
        self.rt.router.observe(Outcome(
            request_id=self.ctx.request_id, model=self.ctx.model, backend=backend,
            policy=self.rt.router.policy_name, status=200 if ok else 502, ok=ok,
            started_at=started_at, ttft_s=None, e2e_s=time.monotonic() - started_at,
            completion_tokens=tokens, moved_to=moved_to, migrations=self.migrations))
