"""Power of two choices: sample two backends, keep the less loaded one."""

from __future__ import annotations

import random
from typing import ClassVar

from pydantic import BaseModel

from policies.base import register
from policies.random_pick import RandomParams
from proxy.types import Backend, ClusterView, Decision, Outcome, Prediction, RequestContext


@register
class PowerOfTwo:
    name: ClassVar[str] = "power_of_two"
    Params: ClassVar[type[BaseModel]] = RandomParams

    def __init__(self, params: RandomParams) -> None:
        self._rng = random.Random(params.seed)

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        if len(view.candidates) == 1:
            return Decision(view.candidates[0], "only candidate")
        a, b = self._rng.sample(view.candidates, 2)
        winner = min((a, b), key=lambda backend: _load(view, backend))
        return Decision(winner, f"less loaded of {a.name}, {b.name}")

    def observe(self, outcome: Outcome) -> None:
        pass


def _load(view: ClusterView, backend: Backend) -> tuple[int, int]:
    # Exact in-flight first; the scrape (which lags) breaks ties.
    stats = view.stats_of(backend)
    return view.inflight_of(backend), stats.running + stats.waiting
