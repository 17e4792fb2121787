"""Cycle through the candidates in order."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel

from policies.base import NoParams, register
from proxy.types import ClusterView, Decision, Outcome, Prediction, RequestContext


@register
class RoundRobin:
    name: ClassVar[str] = "round_robin"
    Params: ClassVar[type[BaseModel]] = NoParams

    def __init__(self, params: NoParams) -> None:
        self._next = 0

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        backend = view.candidates[self._next % len(view.candidates)]
        self._next += 1
        return Decision(backend, "round robin")

    def observe(self, outcome: Outcome) -> None:
        pass
