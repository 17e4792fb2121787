"""Least tokens routed in a sliding window (LiteLLM's `usage-based-routing`).

A backend's score is the real tokens (prompt + completion) of requests that finished
on it within the window, plus an estimate (prompt chars / 4 + max_tokens) for each
request still open on it, so a burst spreads out before any usage is known.
"""

from __future__ import annotations

from collections import deque
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from policies.base import register
from predictors.base import Prediction
from proxy.types import ClusterView, Decision, Outcome, RequestContext


class LowestTpmParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    window_s: float = Field(60.0, gt=0, description="sliding window of the token count")
    default_output_tokens: int = Field(256, ge=0, description="estimate when max_tokens unset")


class _Usage:
    """Finished tokens in the window (time-ordered) plus estimates of open requests."""

    __slots__ = ("finished", "finished_total", "open_estimate")

    def __init__(self) -> None:
        self.finished: deque[tuple[float, int]] = deque()
        self.finished_total = 0
        self.open_estimate = 0

    def score(self, cutoff: float) -> int:
        while self.finished and self.finished[0][0] < cutoff:
            self.finished_total -= self.finished.popleft()[1]
        return self.finished_total + self.open_estimate


@register
class LowestTpm:
    name: ClassVar[str] = "lowest_tpm"
    Params: ClassVar[type[BaseModel]] = LowestTpmParams

    def __init__(self, params: LowestTpmParams) -> None:
        self._params = params
        self._usage: dict[str, _Usage] = {}
        self._open: dict[str, tuple[str, int]] = {}  # request id -> (backend, estimate)
        self._turn = 0

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        cutoff = view.now - self._params.window_s
        self._turn += 1
        n = len(view.candidates)
        best, best_key = view.candidates[0], (0, 0)
        for i in range(n):
            backend = view.candidates[(self._turn + i) % n]
            key = (self._of(backend.name).score(cutoff), view.inflight_of(backend))
            if i == 0 or key < best_key:
                best, best_key = backend, key
        max_tokens = ctx.max_tokens
        if max_tokens is None:
            max_tokens = self._params.default_output_tokens
        estimate = len(ctx.prompt_text) // 4 + max_tokens
        self._of(best.name).open_estimate += estimate
        self._open[ctx.request_id] = (best.name, estimate)
        return Decision(best, f"{best_key[0]} tokens in window")

    def observe(self, outcome: Outcome) -> None:
        opened = self._open.pop(outcome.request_id, None)
        if opened is None:
            return
        backend, estimate = opened
        usage = self._of(backend)
        usage.open_estimate -= estimate
        tokens = (outcome.prompt_tokens or 0) + outcome.completion_tokens
        if tokens:
            usage.finished.append((outcome.started_at + outcome.e2e_s, tokens))
            usage.finished_total += tokens

    def _of(self, name: str) -> _Usage:
        usage = self._usage.get(name)
        if usage is None:
            usage = self._usage[name] = _Usage()
        return usage
