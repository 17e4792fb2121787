"""Join the shortest queue: vLLM's running + waiting (scraped) plus proxy in-flight."""

from __future__ import annotations

from itertools import repeat
from operator import add
from typing import ClassVar

from pydantic import BaseModel

from policies.base import NoParams, register
from policies.load_helpers import RotatingArgmin, candidate_names, inflight_loads
from proxy.types import UNKNOWN_STATS, ClusterView, Decision, Outcome, Prediction, RequestContext


@register
class ShortestQueue:
    name: ClassVar[str] = "shortest_queue"
    Params: ClassVar[type[BaseModel]] = NoParams

    def __init__(self, params: NoParams) -> None:
        self._argmin = RotatingArgmin()

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        # The scrape lags by up to one interval; adding the exact in-flight count makes
        # a burst between two scrapes spread out instead of landing on one backend.
        # (It double-counts requests the scrape already saw: a constant-ish offset per
        # backend that errs on the side of spreading.) Ties: fewer in-flight, then turns.
        names = candidate_names(view)
        inflight = inflight_loads(view, names)
        scraped = map(view.stats.get, names, repeat(UNKNOWN_STATS))
        queues = map(add, [s.running + s.waiting for s in scraped], inflight)
        keys = list(zip(queues, inflight, strict=True))
        at = self._argmin(keys)
        queue, open_here = keys[at]
        return Decision(view.candidates[at], f"shortest queue {queue} ({open_here} in-flight)")

    def observe(self, outcome: Outcome) -> None:
        pass
