"""l(n), the decode step latency at batch size n, learnt from the engine's own steps.

The paper profiles l(n) offline (its Fig. 1). Here a linear prior (`base_ms +
per_seq_ms * n`) answers until a batch size has been seen; each decode-only step
then updates that size's EMA, and the mean ratio observed/prior rescales the prior
for the sizes not seen yet (a slower machine is slower at every size). Steps that
also ran prefill teach the prefill cost per token instead (their time beyond the
decode batch's l(n)), which the planner reserves in the period.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EMA_WEIGHT = 0.2  # of the newest step; ~5 steps of memory, enough to follow load drift


@dataclass(slots=True)
class StepLatencyProfile:
    base_ms: float = 20.0
    per_seq_ms: float = 2.0
    prefill_ms_per_token: float = 0.05
    by_batch_ms: dict[int, float] = field(default_factory=dict)
    prior_scale: float = 1.0

    def prior(self, batch: int) -> float:
        return self.base_ms + self.per_seq_ms * batch

    def __call__(self, batch: int) -> float:
        if batch <= 0:
            return 0.0
        seen = self.by_batch_ms.get(batch)
        return seen if seen is not None else self.prior(batch) * self.prior_scale

    def observe_decode(self, batch: int, step_ms: float) -> None:
        """A step that decoded `batch` requests and ran no prefill."""
        if batch <= 0 or step_ms <= 0:
            return
        old = self.by_batch_ms.get(batch)
        self.by_batch_ms[batch] = step_ms if old is None else _ema(old, step_ms)
        self.prior_scale = _ema(self.prior_scale, step_ms / self.prior(batch))

    def observe_prefill(self, decode_batch: int, prefill_tokens: int, step_ms: float
                        ) -> None:
        """A step that ran `prefill_tokens` prompt tokens beside `decode_batch` decodes."""
        if prefill_tokens <= 0:
            return
        beyond = max(0.0, step_ms - self(decode_batch))
        self.prefill_ms_per_token = _ema(self.prefill_ms_per_token, beyond / prefill_tokens)

    def prefill_ms(self, tokens: int) -> float:
        return max(0, tokens) * self.prefill_ms_per_token


def _ema(old: float, new: float) -> float:
    return (1.0 - EMA_WEIGHT) * old + EMA_WEIGHT * new
