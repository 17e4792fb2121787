"""Send each request to the backend with the fewest requests open via this proxy."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel

from policies.base import NoParams, register
from policies.load_helpers import LeastInflight
from proxy.types import ClusterView, Decision, Outcome, Prediction, RequestContext


@register
class LeastRequest:
    name: ClassVar[str] = "least_request"
    Params: ClassVar[type[BaseModel]] = NoParams

    def __init__(self, params: NoParams) -> None:
        self._least = LeastInflight()

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        backend, load = self._least.pick(view)
        return Decision(backend, f"least in-flight {load}")

    def observe(self, outcome: Outcome) -> None:
        pass
