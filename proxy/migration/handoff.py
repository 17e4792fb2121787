"""Opening a continuation on another backend, and the buffered two-step handoff.

Step 1 (warm, optional): the target prefills `prompt_ids + generated_ids` with a
one-token request while the source keeps streaming to the client, so the target's
prefix cache holds nearly the whole sequence. Step 2: at the next clean token
boundary the source is frozen (its later tokens are never shown) and the target
continues from exactly what the client has; its prefill is only the few tokens past
the cached blocks, so the client's stall is about one decode step. Freezing rather
than racing keeps the splice exact for sampled (non-greedy) requests too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.admission.slo_classes import upstream_body as slo_body
from proxy.migration.eligibility import Tracking, continuation_body, tokenize_bodies, tokenizer_of
from proxy.migration.generation import Generation
from proxy.migration.legs import Leg
from proxy.relay.upstream import Opened, UpstreamFailure
from proxy.runtime import Runtime
from proxy.types import Backend, SloTarget

_PATH = "/v1/completions"
_ERROR_DETAIL = 300
_DECODE_WINDOW = 8  # generated ids decoded to see how the text ends at a boundary
_DECODE_TRIES = 8  # boundaries asked about, the nearest first, before `clean_at`
_DECODE_TIMEOUT_S = 2.0


class HandoffFailed(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Continuation:
    """What a continuation request needs besides the generation itself."""

    rt: Runtime
    data: dict[str, Any]
    tracking: Tracking
    headers: dict[str, str]
    model: str  # the client's model, for metrics
    chat: bool  # the client's endpoint (how its prompt is re-tokenized)
    slo: SloTarget | None = None  # the request's SLO class, carried to every target
    arrived_at: float = 0.0  # when the request arrived (what is left of a deadline)

    def body_for(self, target: Backend, body: bytes) -> bytes:
        """A continuation `body` as `target` takes the request's SLO class (with what
        is left of its deadline now; proxy/admission/slo_classes.py)."""
        if self.slo is None:
            return body
        return orjson.dumps(slo_body(orjson.loads(body), self.slo, target, "completions",
                                     time.monotonic() - self.arrived_at))


async def sequence_for(c: Continuation, gen: Generation, target: Backend
                       ) -> tuple[list[int], str | None, int]:
    """The ids `target` continues from, its tokenizer if the ids were re-tokenized, and
    where the generated ids begin among them.

    Same tokenizer: the prompt ids and generated ids as they are. Another tokenizer
    (per `disco.txt`): the target tokenizes the original prompt (its own chat
    template) and the text generated so far, and continues from there.
    """
    tokenizer = tokenizer_of(target)
    if tokenizer == gen.tokenizer:
        return gen.sequence_ids(), None, gen.output_from
    bodies = tokenize_bodies(c.data, c.chat, c.rt.registry.model_on(target, c.model),
                             gen.text)
    if bodies is None:
        raise HandoffFailed(f"a token-id prompt cannot be re-tokenized for {target.name}")
    try:
        prompt = await c.rt.upstream.call_json(target, "/tokenize", bodies[0], c.headers)
        generated = await c.rt.upstream.call_json(target, "/tokenize", bodies[1], c.headers)
        prompt_ids = [int(t) for t in prompt["tokens"]]
        ids = prompt_ids + [int(t) for t in generated["tokens"]]
    except UpstreamFailure as failure:
        raise HandoffFailed(f"re-tokenizing on {target.name}: {failure.detail}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise HandoffFailed(f"re-tokenizing on {target.name}: {exc!r}") from None
    return ids, tokenizer, len(prompt_ids)


async def open_continuation(c: Continuation, gen: Generation, target: Backend,
                            guard: contextlib.ExitStack | None = None) -> Leg:
    """Continue `gen` on `target`; returns once its first bytes are here."""
    guard = guard or _guard(c.rt, target)
    try:
        context = c.rt.registry.context_of(target.name)
        if c.tracking.max_tokens is None and context is None:
            raise HandoffFailed(
                f"{target.name}'s context length is unknown (its /v1/models not read yet): "
                "a request without max_tokens has no bound to continue with there")
        # `gen` as it is now: in a race the source streams on while this one awaits
        done, since_clean = gen.generated, gen.since_clean
        sequence, tokenizer, output_from = await sequence_for(c, gen, target)
        left_out, chars = (0, 0) if tokenizer is not None else await clean_start(
            c, target, sequence[output_from:], since_clean)
        body = continuation_body(c.data, c.tracking, c.rt.registry.model_on(target, c.model),
                                 sequence[:len(sequence) - left_out], done - left_out,
                                 output_from=output_from, context=context)
        opened = await c.rt.upstream.open(target, _PATH, c.body_for(target, body),
                                          c.headers, stream=True)
        _check(opened)
    except UpstreamFailure as failure:
        guard.close()
        c.rt.upstream_failed(failure, c.model)
        raise HandoffFailed(f"{failure.kind}: {failure.detail[:_ERROR_DETAIL]}") from None
    except BaseException:
        guard.close()
        raise
    leg = Leg(opened, chat=False, guard=guard,
              read_timeout_s=c.rt.settings.upstream.read_timeout_s)
    if tokenizer is not None:
        leg.rebase = (sequence, tokenizer, output_from)
    leg.replay(left_out, chars)
    return leg


async def clean_start(c: Continuation, target: Backend, generated: list[int],
                      since_clean: tuple[int, int]) -> tuple[int, int]:
    """How many of the last `generated` ids (the sequence's) a continuation leaves out,
    so that it starts where their text decodes completely, and how many characters of
    text the client already has of the tokens it then generates again
    (`since_clean`: `Generation.since_clean` when the sequence was taken).

    vLLM 0.32 streams the whole prompt's text in the first delta of a request whose
    prompt ends inside a multi-byte character (its FastIncrementalDetokenizer primes
    tokenizers' DecodeStream with the prompt, which keeps no prefix then: vllm#48853),
    and a continuation's prompt is the answer so far. At a boundary `gen` knows to be
    clean nothing is asked; else the target decodes the ids before each boundary, the
    nearest first. The last clean one found is where the client's text ends (vLLM holds
    a token's text back until it decodes completely), so the tokens past it carry no
    text yet. A backend that cannot tell (no `/detokenize`) continues from `clean_at`."""
    tokens, chars = since_clean
    tokens = min(tokens, len(generated))
    for left_out in range(min(tokens, _DECODE_TRIES)):
        end = len(generated) - left_out
        text = await _decoded(c, target, generated[max(0, end - _DECODE_WINDOW):end])
        if text is None:
            break
        if not text.endswith("\ufffd"):
            return left_out, 0
    return tokens, chars


async def _decoded(c: Continuation, target: Backend, ids: list[int]) -> str | None:
    """vLLM's `/detokenize` of `ids` on `target`; None if it gave no text."""
    body = orjson.dumps({"model": c.rt.registry.model_on(target, c.model), "tokens": ids})
    try:
        answer = await c.rt.upstream.call_json(target, "/detokenize", body, c.headers,
                                               timeout_s=_DECODE_TIMEOUT_S)
    except UpstreamFailure:
        return None
    text = answer.get("prompt") if isinstance(answer, dict) else None
    return text if isinstance(text, str) else None


def _guard(rt: Runtime, target: Backend) -> contextlib.ExitStack:
    guard = contextlib.ExitStack()
    guard.enter_context(rt.registry.guard(target.name))
    return guard


def _check(opened: Opened) -> None:
    if opened.status != 200:
        detail = opened.head[:_ERROR_DETAIL].decode(errors="replace")
        opened.close()
        raise UpstreamFailure(opened.backend, "status", f"HTTP {opened.status}: {detail}",
                              status=opened.status)


@dataclass(slots=True)
class Handoff:
    c: Continuation
    target: Backend
    reason: str
    at_start: int  # tokens generated when the move was decided
    deadline: float
    started_at: float = field(default_factory=time.monotonic)
    guard: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    warm_task: asyncio.Task[Opened] | None = None
    warmed: bool = False

    @classmethod
    def start(cls, c: Continuation, gen: Generation, target: Backend, reason: str, *,
              warm: bool) -> Handoff:
        cfg = c.rt.settings.migration
        handoff = cls(c, target, reason, gen.generated,
                      deadline=time.monotonic() + cfg.handoff_timeout_s,
                      guard=_guard(c.rt, target))
        if warm and gen.prompt_token_ids is not None:
            handoff.warm_task = asyncio.create_task(handoff._warm(gen))
        else:
            handoff.warmed = True
        return handoff

    async def _warm(self, gen: Generation) -> Opened:
        sequence, _, _ = await sequence_for(self.c, gen, self.target)
        model = self.c.rt.registry.model_on(self.target, self.c.model)
        body = continuation_body(self.c.data, self.c.tracking, model, sequence,
                                 gen.generated, warm=True)
        return await self.c.rt.upstream.open(self.target, _PATH,
                                             self.c.body_for(self.target, body),
                                             self.c.headers, stream=False)

    @property
    def ready(self) -> bool:
        """Warm (or not warming): the next clean boundary can cut over."""
        return self.warmed

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    async def wait_either(self, read: asyncio.Future[Any]) -> None:
        """Until the source's read, the warm-up or the deadline, whichever is first."""
        waiting: set[asyncio.Future[Any]] = {read}
        if self.warm_task is not None and not self.warmed:
            waiting.add(self.warm_task)
        await asyncio.wait(waiting, timeout=max(0.0, self.deadline - time.monotonic()),
                           return_when=asyncio.FIRST_COMPLETED)

    def finish_warm(self) -> None:
        """Take the warm-up's result; raises HandoffFailed if it failed or timed out."""
        task = self.warm_task
        if task is None or not task.done():
            if self.expired:
                raise HandoffFailed("handoff timed out while the target prefilled")
            return
        self.warm_task = None
        try:
            opened = task.result()
        except HandoffFailed:
            raise
        except UpstreamFailure as failure:
            self.c.rt.upstream_failed(failure, self.c.model)
            raise HandoffFailed(f"warm-up {failure.kind}: {failure.detail[:_ERROR_DETAIL]}") \
                from None
        try:
            _check(opened)
        except UpstreamFailure as failure:
            raise HandoffFailed(f"warm-up {failure.detail}") from None
        opened.close()
        self.warmed = True

    async def continue_at(self, gen: Generation) -> Leg:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise HandoffFailed("handoff timed out")
        guard, self.guard = self.guard, contextlib.ExitStack()  # the leg owns it now
        try:
            async with asyncio.timeout(remaining):
                return await open_continuation(self.c, gen, self.target, guard)
        except TimeoutError:
            raise HandoffFailed("handoff timed out before the target's first token") from None

    def close(self) -> None:
        if self.warm_task is not None:
            self.warm_task.cancel()
            self.warm_task.add_done_callback(_close_opened)
        self.guard.close()


def _close_opened(task: asyncio.Task[Opened]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close()
