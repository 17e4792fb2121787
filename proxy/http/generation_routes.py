"""`POST /v1/chat/completions` and `POST /v1/completions`: route, relay, account.

The request path of DESIGN.md in one place: parse → predict → pick → relay. Until
the first byte reaches the client, a failing backend is replaced by another (at
most `upstream.max_attempts`); after it, a failure is reported in the stream in
OpenAI's shape and the stream ends cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson

from proxy.admission.auth import Grant
from proxy.admission.flow_control import ANYONE, Place
from proxy.admission.slo_classes import class_of
from proxy.admission.slo_classes import upstream_body as slo_body
from proxy.asgi import ClientGone, Receive, Scope, Send, header_map, read_body
from proxy.errors import ProxyError, RequestDropped
from proxy.http.stored_responses import home_of, response_id_in
from proxy.migration.eligibility import (
    EVENTS_HEADER,
    Tracking,
    forced_after,
    tracked_body,
    tracking_of,
    why_not_migratable,
)
from proxy.migration.legs import Leg
from proxy.migration.tracked_relay import TrackedRelay
from proxy.observability.access_log import note, wait_ms
from proxy.relay.race import NoWinner, Race, RaceLeg, new_race, run_race
from proxy.relay.stream_accounting import (
    MESSAGES_END,
    RESPONSES_END,
    StreamEnd,
    StreamTally,
    body_usage,
)
from proxy.relay.upstream import Opened, UpstreamFailure, exhausted, forward_headers, relay_answer
from proxy.request_context import (
    build_context,
    choices_of,
    client_request_id,
    new_request_id,
    normalized,
    parse_body,
    without_client_controls,
    without_hints,
)
from proxy.routing.kv_transfer import handle_of, without_handle
from proxy.runtime import Runtime
from proxy.types import Backend, Endpoint, Hedge, Outcome, Prediction, RequestContext

_PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
                               "responses": "/v1/responses", "messages": "/v1/messages"}
# Streams that do not end with `[DONE]` (their events are not OpenAI token events either,
# so they never migrate).
_ENDS: dict[Endpoint, StreamEnd] = {"responses": RESPONSES_END, "messages": MESSAGES_END}
log = logging.getLogger("laneway")


async def handle_completion(
    rt: Runtime, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send
) -> None:
    headers = header_map(scope)
    server = rt.settings.server
    try:
        rt.auth.key_of(headers)  # a 401 before a stranger's body is read and parsed
        body = await read_body(headers, receive, server.max_body_bytes, server.body_timeout_s)
        data = parse_body(body, server.max_json_depth)
        if (kept := without_client_controls(data)) is not data:
            data, body = kept, orjson.dumps(kept)
        ctx = build_context(
            data, endpoint, headers,
            request_id=new_request_id(), client_id=client_request_id(headers),
            max_tokens_limit=server.max_tokens_limit,
            session_header=server.session_header,
            block_chars=server.prefix_block_chars,
            default_model=rt.default_model(),
        )
        if (read := normalized(data, ctx)) is not data:  # (the default model, lax types)
            data, body = read, orjson.dumps(read)
        choices, context = choices_of(data), rt.registry.model_context(ctx.model)
        grant, send = rt.admit(scope, send, ctx.model,
                               lambda: rt.auth.admit(headers, ctx, choices, context),
                               anthropic=endpoint == "messages")
        forced = forced_after(headers, rt.settings.debug.allow_forced_migration)
        place = rt.queue_place(grant, headers)
        ctx = dataclasses.replace(ctx, slo_class=class_of(rt.settings, grant, headers))
        if grant is not None and not grant.key.hints:
            ctx = without_hints(ctx)
    except ClientGone:
        return
    except ProxyError as err:
        await rt.refuse(send, err, anthropic=endpoint == "messages")
        return
    tracking = _tracking(rt, ctx, data, forced)
    upstream_headers = forward_headers(scope["headers"], not rt.auth.cfg.enabled)
    home = await _previous_home(rt, ctx, data, upstream_headers)
    exchange = Exchange(rt, ctx, body, data, upstream_headers, send,
                        tracking=tracking, forced_after=forced, grant=grant,
                        announce=headers.get(EVENTS_HEADER) == "1", home=home, place=place)
    await exchange.run(receive)
    note(scope, fallback_from=exchange.fallback_from, model=exchange.ctx.model,
         laneway_id=ctx.request_id if ctx.client_id is not None else None)
    if (outcome := exchange.outcome) is not None:
        note(scope, policy=outcome.policy, prompt_tokens=outcome.prompt_tokens,
             completion_tokens=outcome.completion_tokens,
             migrations=outcome.migrations or None, predicted_tokens=None
             if exchange.predicted_tokens is None else round(exchange.predicted_tokens),
             stream_failed=outcome.status == 502 or None)  # (after a 200: an error event)
    note(scope, client_left=exchange.client_gone or None, queued_ms=wait_ms(exchange.queued_s))


async def _previous_home(rt: Runtime, ctx: RequestContext, data: dict[str, Any],
                         headers: dict[str, str]) -> str | None:
    """For a Responses API request continuing a stored response: the backend that holds
    it (the request must go there), if one of the candidates does."""
    previous = data.get("previous_response_id") if ctx.endpoint == "responses" else None
    if not isinstance(previous, str) or not previous:
        return None
    candidates = rt.registry.view(ctx.model, time.monotonic()).candidates
    home = await home_of(rt, previous, candidates, headers)
    if home is None:
        log.info("request %s: no candidate holds previous response %s; the policy picks",
                 ctx.request_id, previous)
    return None if home is None else home.name


def _tracking(
    rt: Runtime, ctx: RequestContext, data: dict[str, Any], forced: int | None
) -> Tracking | None:
    """How the request is tracked for migration, or None for a plain byte relay."""
    cfg = rt.settings.migration
    wanted = ctx.stream or cfg.non_stream or rt.router.reroutes or forced is not None
    if not cfg.enabled or not wanted:
        return None
    if ctx.endpoint in _ENDS:  # its events are not tokens; nothing to continue from
        log.debug("request %s is not migratable (%s API)", ctx.request_id, ctx.endpoint)
        return None
    why_not = why_not_migratable(data, ctx.endpoint == "chat")
    if why_not is not None:
        log.debug("request %s is not migratable (%s)", ctx.request_id, why_not)
        return None
    return tracking_of(data, ctx.max_tokens)


class Exchange:
    """One routed request, from the first pick to the last byte sent."""

    def __init__(
        self, rt: Runtime, ctx: RequestContext, body: bytes, data: dict[str, Any],
        headers: dict[str, str], send: Send, *, tracking: Tracking | None = None,
        forced_after: int | None = None, announce: bool = False, grant: Grant | None = None,
        home: str | None = None, place: Place = ANYONE,
    ) -> None:
        self.rt, self.ctx, self.body, self.data, self.headers, self.send = (
            rt, ctx, body, data, headers, send)
        self.tracking, self.forced_after, self.announce = tracking, forced_after, announce
        self.relay: TrackedRelay | None = None
        self.finished = False  # set before the last send, so a late disconnect is ignored
        self.client_gone = False
        self.tally: StreamTally | None = None
        self.backend_name = "-"  # the backend being tried, for metrics
        self.grant = grant
        self.home = home  # the one backend to try first (it holds previous_response_id)
        self.outcome: Outcome | None = None  # the final leg's, for `rt.finished`
        self.predicted_tokens: float | None = None  # the length predictor's, at arrival
        self.fallback_from: str | None = None  # the requested model, once it fell back
        self.place = place  # its place in flow control's queue
        self.queued_s = 0.0  # time it waited there
        self.race: Race | None = None  # the policy's hedged race, if it asked for one

    async def run(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(self._watch_disconnect(receive, task))
        try:
            await self._route_and_relay()
        except asyncio.CancelledError:
            if not self.client_gone:
                raise
            task.uncancel()  # we cancelled ourselves because the client left
            self.rt.metrics.disconnects.labels(self.ctx.model, self.backend_name).inc()
        except ProxyError as err:
            await self.rt.refuse(self.send, err, anthropic=self.ctx.endpoint == "messages")
        finally:
            self.finished = True
            watcher.cancel()
            self.rt.finished(self.ctx, self.grant, self.outcome, self.predicted_tokens)

    async def _watch_disconnect(self, receive: Receive, task: asyncio.Task[None]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.finished and not (self.relay is not None and self.relay.done):
            self.client_gone = True
            task.cancel()

    async def _route_and_relay(self) -> None:
        rt, ctx = self.rt, self.ctx
        failures: list[UpstreamFailure] = []
        pred = await rt.router.prepare(  # e.g. ELDR's prefill leg, qos_drl's encoder
            ctx, self.data, self._predict(),
            lambda: rt.registry.view(ctx.model, time.monotonic()))
        body = self.body if self.tracking is None else tracked_body(self.data, self.tracking)
        stream = ctx.stream or self.tracking is not None
        kv_handle = handle_of(pred)  # ELDR PD with kv_transfer: where the prompt's KV is
        requested = ctx.model
        for rounds in itertools.count():
            for model in rt.models_to_try(requested):
                if model != ctx.model:
                    ctx = self.ctx = self._fall_back(requested, model, failures)
                    kv_handle, self.home = None, None
                if await self._attempts(ctx, pred, body, stream, kv_handle, failures):
                    return
                kv_handle = None  # the prefill leg's KV is on the first model's backends
            pause = rt.retry_pause(requested, ctx.arrived_at, rounds, failures)
            if pause is None:
                raise exhausted(requested, failures, rt.settings.server.retry_after_s)
            await asyncio.sleep(pause)
            failures.clear()
            ctx = self.ctx = dataclasses.replace(ctx, model=requested)
            self.fallback_from = None

    def _fall_back(self, requested: str, model: str, failures: list[UpstreamFailure]
                   ) -> RequestContext:
        """The request for `requested`, now for its fallback `model` (`model_fallbacks`)."""
        self.rt.falling_back(self.ctx.request_id, requested, self.ctx.model, model, failures)
        self.fallback_from = requested
        return dataclasses.replace(self.ctx, model=model)

    async def _attempts(self, ctx: RequestContext, pred: Prediction, body: bytes,
                        stream: bool, kv_handle: Mapping[str, Any] | None,
                        failures: list[UpstreamFailure]) -> bool:
        """Up to `upstream.max_attempts` backends of `ctx.model`; True once one answered
        (and the answer was relayed), False when none did (`failures` says why)."""
        rt = self.rt
        tried: list[str] = []
        for _ in range(rt.settings.upstream.max_attempts):
            held = time.monotonic()
            view = await rt.flow.view(ctx.model, tried, self.place)  # may wait for room
            self.queued_s += time.monotonic() - held
            if not view.candidates:
                break
            if self.home is not None and not tried:
                pinned = tuple(b for b in view.candidates if b.name == self.home)
                view = dataclasses.replace(view, candidates=pinned or view.candidates)
            decision = rt.router.pick(ctx, pred, view)
            backend = decision.backend
            if decision.drop is not None:
                self._observe_attempt(backend.name, RequestDropped.status)
                raise RequestDropped(f"request dropped by the routing policy: {decision.drop}")
            tried.append(backend.name)
            self.backend_name = backend.name
            hedge = decision.hedge
            if hedge is not None and hedge.backend.name == backend.name:
                hedge = None  # (a race against itself would only double the work)
            tracked = self._tracked_on(backend.name) and (
                hedge is None or self._tracked_on(hedge.backend.name))
            open_on = functools.partial(
                self._open_on, body=body if tracked else self.body,
                stream=stream if tracked else ctx.stream, kv_on=backend, kv_handle=kv_handle)

            guard = contextlib.ExitStack()
            self.race = None
            try:
                if hedge is None:  # the common case: no task, no race
                    if "side" in backend.labels:  # (DiSCo's backends)
                        rt.metrics.decided(rt.router.policy_name, backend, None)
                    guard.enter_context(rt.registry.guard(backend.name))
                    opened = await open_on(backend)
                else:
                    tried.append(hedge.backend.name)
                    opened = await self._race(backend, hedge, open_on, guard, failures)
                if tracked and not opened.complete:
                    await self._relay_tracked(opened, guard, pred)
                    return True
            except UpstreamFailure as failure:
                guard.close()
                self._attempt_failed(failure, failures)
                if failure.kind != "connect":  # it may have pulled (so freed) the KV blocks
                    kv_handle = None
                continue
            except NoWinner:  # each leg's failure is in `failures` already
                kv_handle = None
                continue
            except asyncio.CancelledError:
                guard.close()
                if self.relay is None and self.race is None:
                    self._observe_attempt(backend.name, 499)
                raise
            with guard:
                try:
                    if kv_handle is not None and opened.complete:
                        opened.head = without_handle(opened.head)
                    await self._respond(opened)
                finally:
                    opened.close()
                    self._account(opened)
            return True
        return False

    def _open_on(self, target: Backend, *, body: bytes, stream: bool, kv_on: Backend,
                 kv_handle: Mapping[str, Any] | None) -> Awaitable[Opened]:
        """Send the request to `target` (with the KV handle only if it is `kv_on`)."""
        rt, ctx = self.rt, self.ctx
        return rt.upstream.open(
            target, _PATHS[ctx.endpoint],
            self._upstream_body(body, rt.registry.model_on(target, ctx.model),
                                kv_handle if target is kv_on else None, target),
            self.headers, stream)

    def _tracked_on(self, backend: str) -> bool:
        """Whether the request is tracked on `backend`: not on one seen streaming
        reasoning, where a stream stays anyway (proxy/migration/tracked_relay.py) and the server's
        own
        bytes are exact (e.g. a stop string found inside the reasoning, which a
        tracked stream, asking for stop strings in the output, would show)."""
        if self.tracking is None:
            return False
        if backend in self.rt.streams.reasoning:
            log.debug("request %s: %s streams reasoning; relayed as it answers",
                      self.ctx.request_id, backend)
            return False
        return True

    def _upstream_body(self, body: bytes, model: str,
                       kv_handle: Mapping[str, Any] | None, backend: Backend) -> bytes:
        """`body` naming `model` (a model group's request goes to a member model: see
        Registry.model_on), with the prefill leg's KV handle if there is one
        (proxy/routing/kv_transfer.py), and the request's SLO class as `backend` takes
        it (proxy/admission/slo_classes.py)."""
        changes: dict[str, Any] = {}
        if model != (self.fallback_from or self.ctx.model):  # what the body names
            changes["model"] = model
        if kv_handle is not None:
            changes["kv_transfer_params"] = dict(kv_handle)
        slo = self.ctx.slo_class
        if slo is not None:
            return orjson.dumps(slo_body(orjson.loads(body) | changes, slo, backend,
                                         self.ctx.endpoint,
                                         time.monotonic() - self.ctx.arrived_at))
        return orjson.dumps(orjson.loads(body) | changes) if changes else body

    def _predict(self) -> Prediction:
        started = time.perf_counter()
        pred = self.rt.predict(self.ctx)
        self.rt.metrics.prediction.observe(time.perf_counter() - started)
        self.predicted_tokens = pred.output_tokens
        return pred

    async def _relay_tracked(self, opened: Opened, guard: contextlib.ExitStack,
                             pred: Prediction) -> None:
        """Relay a request that may migrate (see proxy/migration/tracked_relay.py)."""
        assert self.tracking is not None
        rt, ctx = self.rt, self.ctx
        relay = TrackedRelay(rt, ctx, self.data, self.tracking, self.headers, self.send,
                             forced_after=self.forced_after, announce=self.announce,
                             pred=pred)
        leg = Leg(opened, ctx.endpoint == "chat", guard, rt.settings.upstream.read_timeout_s)
        self.relay = relay
        try:
            await relay.run(leg)
        except UpstreamFailure:
            self.relay = None  # nothing reached the client: the caller tries elsewhere
            raise
        finally:
            relay.close()
            if self.relay is not None:
                self.finished = True
                assert relay.leg is not None  # (the leg it ended on)
                self._observe(relay.final_outcome(self.client_gone), relay.leg.backend)

    def _observe_attempt(self, backend: str, status: int, ran_s: float | None = None
                         ) -> None:
        """Tell the policy that its pick did not get a response (see Policy.observe);
        `ran_s`: how long that leg ran (default: since the request arrived)."""
        ctx = self.ctx
        self.rt.router.observe(Outcome(
            request_id=ctx.request_id, model=ctx.model, backend=backend,
            policy=self.rt.router.policy_name, status=status, ok=False,
            started_at=ctx.arrived_at, ttft_s=None, completion_tokens=0,
            e2e_s=time.monotonic() - ctx.arrived_at if ran_s is None else ran_s))

    async def _respond(self, opened: Opened) -> None:
        self.tally = StreamTally(time.monotonic(), _ENDS.get(self.ctx.endpoint))
        await relay_answer(opened, self.send, self.ctx.echo_id, self.tally,
                           self.rt.settings.upstream.read_timeout_s,
                           self.rt.count_upstream_error, self._finishing)

    def _finishing(self) -> None:
        self.finished = True

    def _account(self, opened: Opened) -> None:
        ctx, tally = self.ctx, self.tally
        now = time.monotonic()
        if tally is None:  # cancelled before the first byte was sent
            status, ok, ttft, tokens, prompt_tokens, tpot = 499, False, None, 0, None, None
        else:
            status = 499 if self.client_gone else (502 if tally.failed else opened.status)
            ok = status == 200
            ttft = tally.first_at - ctx.arrived_at
            if opened.complete:
                prompt_tokens, tokens = body_usage(opened.head)
                tpot = None
            else:
                prompt_tokens, tokens = tally.usage(ctx.endpoint == "chat")
                tpot = tally.tpot(tokens)
        outcome = Outcome(
            request_id=ctx.request_id, model=ctx.model, backend=opened.backend.name,
            policy=self.rt.router.policy_name, status=status, ok=ok,
            started_at=ctx.arrived_at, ttft_s=ttft, e2e_s=now - ctx.arrived_at,
            completion_tokens=tokens, prompt_tokens=prompt_tokens, tpot_s=tpot,
        )
        if ctx.endpoint == "responses" and status == 200:
            response_id = response_id_in(opened.head)
            if response_id is not None:
                self.rt.responses.learn(response_id, opened.backend.name)
        self._observe(outcome, opened.backend)

    def _observe(self, outcome: Outcome, backend: Backend) -> None:
        """The request's final outcome (it ended on `backend`), to metrics and to the
        policy. After a race the policy learns the winning leg's own times (from its
        start: a hedge starts `delay_s` after the request); the loser was observed as
        it was aborted (`_race`). Requests on backends with a `side` label (DiSCo) count
        their tokens per side and their cost."""
        self.outcome = outcome
        metrics = self.rt.metrics
        metrics.observe(outcome)
        race = self.race
        if race is None or race.winner is None:
            self.rt.router.observe(outcome)
            if "side" in backend.labels:
                metrics.observe_leg(backend, outcome.prompt_tokens, outcome.completion_tokens)
            return
        winner, loser = race.winner, race.loser
        assert winner.started_at is not None
        late = winner.started_at - self.ctx.arrived_at
        self.rt.router.observe(dataclasses.replace(
            outcome, e2e_s=outcome.e2e_s - late,
            ttft_s=None if outcome.ttft_s is None else outcome.ttft_s - late))
        metrics.observe_leg(backend, outcome.prompt_tokens, outcome.completion_tokens)
        if loser is not None and loser.started_at is not None and loser.failure is None:
            # an aborted leg paid its prefill: the whole prompt, as the budget counts it
            metrics.observe_leg(loser.backend, outcome.prompt_tokens, 0)

    async def _race(self, backend: Backend, hedge: Hedge,
                    open_on: Callable[[Backend], Awaitable[Opened]],
                    guard: contextlib.ExitStack, failures: list[UpstreamFailure]) -> Opened:
        """The policy's race (proxy/relay/race.py): the winner's answer, its slot moved
        into `guard`; the loser observed as aborted (499, no TTFT, `e2e_s` its run: a
        censored sample). Raises NoWinner when both failed (each recorded in `failures`)."""
        rt, ctx = self.rt, self.ctx
        race = self.race = new_race(backend, hedge.backend, hedge.delay_s)
        rt.metrics.decided(rt.router.policy_name, backend, hedge)

        def failed(leg: RaceLeg) -> None:  # the other leg continues, or opens now
            assert leg.failure is not None
            self._attempt_failed(leg.failure, failures, leg.ran_s)

        try:
            await run_race(race, open_on, rt.registry.guard, rt.flow.has_room,
                           ctx.endpoint == "chat",
                           rt.settings.upstream.read_timeout_s, failed)
        except asyncio.CancelledError:
            for leg in (race.first, race.second):
                if leg.started_at is not None and leg.failure is None:
                    self._observe_attempt(leg.backend.name, 499, leg.ran_s)
            raise
        winner, loser = race.winner, race.loser
        if winner is None:
            raise NoWinner
        if loser is not None and loser.started_at is not None and loser.failure is None:
            self._observe_attempt(loser.backend.name, 499, loser.ran_s)
        assert winner.opened is not None
        guard.enter_context(winner.guard.pop_all())
        self.backend_name = winner.backend.name
        rt.metrics.race_won(winner, race.hedge_opened)
        log.info("request %s: race %s vs %s (hedge after %.3f s, %s): %s won, token after "
                 "%.3f s%s", ctx.request_id, backend.name, hedge.backend.name, hedge.delay_s,
                 "opened" if race.hedge_opened else "full: not opened"
                 if race.second.no_room else "not opened", winner.backend.name,
                 winner.ran_s, "" if loser is None or loser.started_at is None else
                 f"; {loser.backend.name} aborted after {loser.ran_s:.3f} s")
        return winner.opened

    def _attempt_failed(self, failure: UpstreamFailure, failures: list[UpstreamFailure],
                        ran_s: float | None = None) -> None:
        failures.append(failure)
        self.rt.upstream_failed(failure, self.ctx.model)
        self._observe_attempt(failure.backend.name, 504 if failure.kind == "timeout" else 502,
                              ran_s)

