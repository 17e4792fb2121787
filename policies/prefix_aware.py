"""Send a prompt where its longest prefix was sent before (KV-cache reuse).

The index maps each cumulative prefix-block hash (`ctx.prompt_blocks`) to the backend
that last received it, bounded as an LRU. Requests with no (or too short a) match go
to the least-loaded backend.

The load guard follows SGLang's cache-aware router (`balance_abs_threshold`,
`balance_rel_threshold`: overloaded when both `load - min > abs` and
`load > rel * min`), with two deliberate differences: it tests the *matched* backend
rather than the fleet's busiest one, so an imbalance elsewhere does not throw away a
cache hit; and it compares against `min + 1`, so an idle fleet (min = 0) does not make
any load at all look infinitely relatively worse.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, ClassVar

from pydantic import BaseModel, Field

from policies.base import PARAMS_CONFIG, register
from policies.load_helpers import CacheOrLeast, CandidatesByName
from policies.prefix_index import blocks_from_wire, blocks_to_wire
from proxy.types import Backend, ClusterView, Decision, Outcome, Prediction, RequestContext

OUTBOX_MAX = 10_000  # writes kept for replication while the store is unreachable


class PrefixAwareParams(BaseModel):
    model_config = PARAMS_CONFIG
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
        self._choose = CacheOrLeast(params.balance_abs_threshold,
                                    params.balance_rel_threshold).choose
        self._by_name = CandidatesByName()
        self._outbox: deque[list[str]] | None = None  # writes to replicate, once asked

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        matched, depth = self._longest_match(ctx.prompt_blocks, view)
        decision = self._choose(view, matched, f"prefix match {depth} blocks",
                                depth >= self._params.min_match_blocks)
        self._remember(ctx.prompt_blocks, decision.backend.name)
        return decision

    def observe(self, outcome: Outcome) -> None:
        pass

    def export_updates(self) -> list[Any]:
        if self._outbox is None:
            self._outbox = deque(maxlen=OUTBOX_MAX)
        updates = list(self._outbox)
        self._outbox.clear()
        return updates

    def merge_updates(self, updates: list[Any]) -> None:
        for name, wire in updates:
            self._insert(blocks_from_wire(wire), name)

    def _longest_match(
        self, blocks: tuple[bytes, ...], view: ClusterView
    ) -> tuple[Backend | None, int]:
        # The indexed blocks of any prompt form a prefix (see `_remember`), so a binary
        # search finds how many are known; then step back to the deepest one whose
        # owner is still a candidate (usually the first one looked at).
        index = self._index
        lo, hi = 0, len(blocks)  # blocks[:lo] known, blocks[hi:] unknown
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if blocks[mid - 1] in index:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            return None, 0
        by_name = self._by_name(view.candidates)
        for depth in range(lo, 0, -1):
            backend = by_name.get(index[blocks[depth - 1]])
            if backend is not None:
                return backend, depth
        return None, 0

    def _remember(self, blocks: tuple[bytes, ...], name: str) -> None:
        self._insert(blocks, name)
        if self._outbox is not None and blocks:
            self._outbox.append([name, blocks_to_wire(blocks)])

    def _insert(self, blocks: tuple[bytes, ...], name: str) -> None:
        # Deepest first, so a prefix is always touched after its extensions: the LRU
        # then evicts extensions before their prefixes and what stays indexed of any
        # prompt is a prefix of it, which `_longest_match` relies on.
        index = self._index
        for block in reversed(blocks):
            index[block] = name
            index.move_to_end(block)
        while len(index) > self._params.max_entries:
            index.popitem(last=False)
