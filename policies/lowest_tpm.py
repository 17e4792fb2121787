"""Least tokens routed in a sliding window (LiteLLM's `usage-based-routing`).

A backend's score is the real tokens (prompt + completion, from `observe`) of requests
that finished on it within the last `window_s`, plus an estimate for each request still
open on it, so a burst spreads out before any usage is known. The estimate is
`len(prompt_text) // 4` (≈ tokens of English text under common BPE tokenizers) plus the
expected output: the predictor's `output_tokens` when there is one, else `max_tokens`,
else `default_output_tokens`; any of these capped by `max_tokens`. When the request
finishes its estimate is replaced by the reported usage.

State is one time-ordered deque of finished usage for all backends plus a running
total per backend, so a pick costs one dict lookup per candidate and expiry is O(1)
amortized. `view.now` is the clock (the proxy's monotonic time, as in `Outcome`).
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from typing import ClassVar

from pydantic import BaseModel, Field

from policies.base import PARAMS_CONFIG, register
from policies.load_helpers import RotatingArgmin, candidate_names, inflight_loads
from proxy.types import ClusterView, Decision, Outcome, Prediction, RequestContext


class LowestTpmParams(BaseModel):
    model_config = PARAMS_CONFIG
    window_s: float = Field(60.0, gt=0, description="sliding window of the token count")
    default_output_tokens: int = Field(
        256, ge=0, description="output estimate with neither prediction nor max_tokens")


@register
class LowestTpm:
    name: ClassVar[str] = "lowest_tpm"
    Params: ClassVar[type[BaseModel]] = LowestTpmParams

    def __init__(self, params: LowestTpmParams) -> None:
        self._params = params
        self._tokens: dict[str, int] = {}  # backend -> finished in window + open estimates
        self._finished: deque[tuple[float, str, int]] = deque()  # (finished at, backend, n)
        self._open: dict[str, tuple[str, int]] = {}  # request id -> (backend, estimate)
        self._argmin = RotatingArgmin()

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        self._expire(view.now - self._params.window_s)
        names = candidate_names(view)
        tokens = map(self._tokens.get, names, repeat(0))
        # Ties (idle fleet, equal estimates): fewer in-flight, then take turns.
        keys = list(zip(tokens, inflight_loads(view, names), strict=True))
        at = self._argmin(keys)
        chosen = view.candidates[at]
        estimate = self.estimate(ctx, pred)
        self._add(chosen.name, estimate)
        self._open[ctx.request_id] = (chosen.name, estimate)
        return Decision(chosen, f"lowest tokens in window {keys[at][0]}")

    def observe(self, outcome: Outcome) -> None:
        opened = self._open.pop(outcome.request_id, None)
        if opened is None:
            return
        backend, estimate = opened
        self._add(backend, -estimate)
        used = (outcome.prompt_tokens or 0) + outcome.completion_tokens
        if used:
            self._finished.append((outcome.started_at + outcome.e2e_s, backend, used))
            self._add(backend, used)

    def tokens_in_window(self, backend: str, now: float) -> int:
        """Finished plus open-estimated tokens charged to `backend` (for tests, logs)."""
        self._expire(now - self._params.window_s)
        return self._tokens.get(backend, 0)

    def estimate(self, ctx: RequestContext, pred: Prediction) -> int:
        cap = ctx.max_tokens
        if pred.output_tokens is not None:
            output = round(pred.output_tokens)
        elif cap is not None:
            output = cap
        else:
            output = self._params.default_output_tokens
        if cap is not None:
            output = min(output, cap)
        return len(ctx.prompt_text) // 4 + output

    def _expire(self, cutoff: float) -> None:
        finished = self._finished
        while finished and finished[0][0] < cutoff:
            _, backend, used = finished.popleft()
            self._add(backend, -used)

    def _add(self, backend: str, tokens: int) -> None:
        self._tokens[backend] = self._tokens.get(backend, 0) + tokens
