"""Join the shortest queue: vLLM's running + waiting (scraped) plus proxy in-flight."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel

from policies.base import NoParams, register
from predictors.base import Prediction
from proxy.types import ClusterView, Decision, Outcome, RequestContext


@register
class ShortestQueue:
    name: ClassVar[str] = "shortest_queue"
    Params: ClassVar[type[BaseModel]] = NoParams

    def __init__(self, params: NoParams) -> None:
        self._turn = 0

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        # The scrape lags by up to one interval; adding the exact in-flight count makes
        # a burst between two scrapes spread out instead of landing on one backend.
        self._turn += 1
        n = len(view.candidates)
        best, best_key = None, (0, 0)
        for i in range(n):
            backend = view.candidates[(self._turn + i) % n]
            stats = view.stats_of(backend)
            inflight = view.inflight_of(backend)
            key = (stats.running + stats.waiting + inflight, inflight)
            if best is None or key < best_key:
                best, best_key = backend, key
        assert best is not None
        return Decision(best, f"queue {best_key[0]}")

    def observe(self, outcome: Outcome) -> None:
        pass
