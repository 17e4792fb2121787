"""Session affinity by consistent hashing (Karger et al.), so adding or losing a
backend moves only the sessions that hashed to it (about 1/N of them).

The session is `ctx.session` (the configured header, else the OpenAI `user` field);
requests without one go to the least-loaded backend.
"""

from __future__ import annotations

import bisect
import hashlib
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from policies._load import LeastInflight
from policies.base import register
from predictors.base import Prediction
from proxy.types import Backend, ClusterView, Decision, Outcome, RequestContext


class SessionParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    virtual_nodes: int = Field(100, ge=1, description="ring points per backend")


def stable_hash(key: str) -> int:
    """Same on every replica and every run (unlike Python's salted `hash`)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class _Ring:
    __slots__ = ("backends", "points")

    def __init__(self, candidates: tuple[Backend, ...], virtual_nodes: int) -> None:
        ring = sorted(
            (stable_hash(f"{backend.name}#{v}"), backend)
            for backend in candidates
            for v in range(virtual_nodes)
        )
        self.points = [point for point, _ in ring]
        self.backends = [backend for _, backend in ring]

    def lookup(self, key: str) -> Backend:
        at = bisect.bisect(self.points, stable_hash(key)) % len(self.points)
        return self.backends[at]


@register
class Session:
    name: ClassVar[str] = "session"
    Params: ClassVar[type[BaseModel]] = SessionParams

    def __init__(self, params: SessionParams) -> None:
        self._params = params
        self._rings: dict[tuple[str, ...], _Ring] = {}
        self._least = LeastInflight()

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        if not ctx.session:
            backend, load = self._least.pick(view)
            return Decision(backend, f"no session; least in-flight ({load})")
        return Decision(self._ring(view.candidates).lookup(ctx.session), "session affinity")

    def observe(self, outcome: Outcome) -> None:
        pass

    def _ring(self, candidates: tuple[Backend, ...]) -> _Ring:
        # The candidate set changes only with health or retries: a handful of rings.
        key = tuple(b.name for b in candidates)
        ring = self._rings.get(key)
        if ring is None:
            if len(self._rings) >= 64:
                self._rings.clear()
            ring = self._rings[key] = _Ring(candidates, self._params.virtual_nodes)
        return ring
