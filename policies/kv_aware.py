"""Send a prompt to the backend whose KV cache holds the longest prefix of it.

The score of a candidate is how many of the prompt's leading tokens it has cached:
exact for a backend with KV events (`Prediction.cached_prefix_tokens`, computed
before the pick by the `CachedPrefix` stage from the backend's own events), and
prefix_aware's approximation for one without (which prefixes this policy sent where,
converted from characters to tokens), also for every backend when the stage could
not tokenize the prompt. The highest score wins, ties to the least loaded; a best
score under `min_match_tokens` goes to the least-loaded backend.

The load guard is prefix_aware's (SGLang's `balance_abs_threshold` and
`balance_rel_threshold`, against `min + 1`): the best-cached backend is passed over
for the least-loaded one when both its in-flight gap and ratio are too large.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, Field

from policies.base import PARAMS_CONFIG, register
from policies.load_helpers import CacheOrLeast
from policies.prefix_index import PrefixIndex
from proxy.types import (
    CachedPrefix,
    ClusterView,
    Decision,
    Outcome,
    Prediction,
    RequestContext,
    StageSpec,
)


class KvAwareParams(BaseModel):
    model_config = PARAMS_CONFIG
    min_match_tokens: int = Field(1, ge=1, description="a shorter cached prefix is ignored")
    balance_abs_threshold: int = Field(8, ge=0, description="in-flight gap tolerated")
    balance_rel_threshold: float = Field(1.5, ge=1.0, description="in-flight ratio tolerated")
    tokenize_timeout_s: float = Field(0.5, gt=0, description="the backend's /tokenize; "
                                      "slower: this request routes on the approximation")
    max_entries: int = Field(100_000, gt=0, description="prefix blocks remembered for "
                             "backends without KV events (LRU)")
    chars_per_token: float = Field(4.0, gt=0, description="converts the approximation's "
                                   "matched characters into tokens")


@register
class KvAware:
    name: ClassVar[str] = "kv_aware"
    Params: ClassVar[type[BaseModel]] = KvAwareParams

    def __init__(self, params: KvAwareParams) -> None:
        self._params = params
        self._sent = PrefixIndex(params.max_entries)  # the approximation, as prefix_aware's
        self._choose = CacheOrLeast(params.balance_abs_threshold,
                                    params.balance_rel_threshold).choose

    def stages(self) -> tuple[StageSpec, ...]:
        return (CachedPrefix(self._params.tokenize_timeout_s),)

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        scores = self._scores(ctx, pred, view)
        best = max(view.candidates,
                   key=lambda b: (scores.get(b.name, 0), -view.inflight_of(b)))
        tokens = scores.get(best.name, 0)
        exact = pred.cached_prefix_tokens is not None and best.name in pred.cached_prefix_tokens
        decision = self._choose(view, best,
                                f"{tokens} prefix tokens {'cached' if exact else 'sent (approx.)'}",
                                tokens >= self._params.min_match_tokens)
        self._sent.remember(ctx.prompt_blocks, decision.backend.name)
        return decision

    def observe(self, outcome: Outcome) -> None:
        pass

    def _scores(self, ctx: RequestContext, pred: Prediction,
                view: ClusterView) -> dict[str, int]:
        exact = pred.cached_prefix_tokens or {}
        scores = {b.name: exact[b.name] for b in view.candidates if b.name in exact}
        if len(scores) == len(view.candidates) or not ctx.prompt_blocks:
            return scores
        # `prompt_blocks` cover the prompt text in equal blocks: a matched depth is
        # that share of its characters
        tokens_per_block = len(ctx.prompt_text) / len(ctx.prompt_blocks) \
            / self._params.chars_per_token
        for name, depth in self._sent.matched_blocks(ctx.prompt_blocks).items():
            if name not in scores:
                scores[name] = int(depth * tokens_per_block)
        return scores
