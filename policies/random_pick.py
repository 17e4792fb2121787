"""Uniformly random choice (the baseline every paper compares against)."""

from __future__ import annotations

import random
from typing import ClassVar

from pydantic import BaseModel

from policies.base import PARAMS_CONFIG, register
from proxy.types import ClusterView, Decision, Outcome, Prediction, RequestContext


class RandomParams(BaseModel):
    model_config = PARAMS_CONFIG
    seed: int | None = None


@register
class RandomPick:
    name: ClassVar[str] = "random"
    Params: ClassVar[type[BaseModel]] = RandomParams

    def __init__(self, params: RandomParams) -> None:
        self._rng = random.Random(params.seed)

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        return Decision(self._rng.choice(view.candidates), "random")

    def observe(self, outcome: Outcome) -> None:
        pass
