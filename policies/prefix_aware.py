"""Send a prompt where its longest prefix was sent before (KV-cache reuse).

The index maps each cumulative prefix-block hash (`ctx.prompt_blocks`) to the backend
that last received it, bounded as an LRU. A load guard in the spirit of SGLang's
cache-aware router (`balance_abs_threshold` / `balance_rel_threshold`) gives up the
cache hit when the matching backend is overloaded against the least-loaded one, and
requests with no (or too short a) match go to the least-loaded backend.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from policies._load import LeastInflight
from policies.base import register
from predictors.base import Prediction
from proxy.types import Backend, ClusterView, Decision, Outcome, RequestContext


class PrefixAwareParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    max_entries: int = Field(100_000, gt=0, description="prefix blocks remembered (LRU)")
    min_match_blocks: int = Field(1, ge=1, description="shorter matches are ignored")
    balance_abs_threshold: int = Field(8, ge=0, description="in-flight gap tolerated")
    balance_rel_threshold: float = Field(1.5, ge=1.0, description="in-flight ratio tolerated")


@register
class PrefixAware:
    name: ClassVar[str] = "prefix_aware"
    Params: ClassVar[type[BaseModel]] = PrefixAwareParams

    def __init__(self, params: PrefixAwareParams) -> None:
        self._params = params
        self._index: OrderedDict[bytes, str] = OrderedDict()
        self._least = LeastInflight()

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        matched, depth = self._longest_match(ctx.prompt_blocks, view)
        least, least_load = self._least.pick(view)
        if matched is None or depth < self._params.min_match_blocks:
            choice, reason = least, f"no prefix match; least in-flight ({least_load})"
        elif self._overloaded(view.inflight_of(matched), least_load):
            choice = least
            reason = f"prefix match {depth} blocks on overloaded {matched.name}; least in-flight"
        else:
            choice, reason = matched, f"prefix match {depth} blocks"
        self._remember(ctx.prompt_blocks, choice.name)
        return Decision(choice, reason)

    def observe(self, outcome: Outcome) -> None:
        pass

    def _longest_match(
        self, blocks: tuple[bytes, ...], view: ClusterView
    ) -> tuple[Backend | None, int]:
        # Blocks are cumulative, so matches are consecutive from the start: walk until
        # the first block nobody has, keeping the deepest one held by a candidate.
        by_name: dict[str, Backend] | None = None
        best: Backend | None = None
        depth = 0
        for i, block in enumerate(blocks):
            owner = self._index.get(block)
            if owner is None:
                break
            if by_name is None:
                by_name = {b.name: b for b in view.candidates}
            backend = by_name.get(owner)
            if backend is not None:
                best, depth = backend, i + 1
        return best, depth

    def _overloaded(self, matched_load: int, least_load: int) -> bool:
        p = self._params
        return (matched_load - least_load > p.balance_abs_threshold
                and matched_load > p.balance_rel_threshold * (least_load + 1))

    def _remember(self, blocks: tuple[bytes, ...], name: str) -> None:
        index = self._index
        for block in blocks:
            index[block] = name
            index.move_to_end(block)
        while len(index) > self._params.max_entries:
            index.popitem(last=False)
