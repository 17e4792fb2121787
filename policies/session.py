"""Session affinity by consistent hashing (Karger et al.), so adding or losing a
backend moves only the sessions that hashed to it (about 1/N of them).

The session is `ctx.session` (the configured header, else the OpenAI `user` field);
requests without one go to the least-loaded backend.

There is one ring per model, over every backend seen serving it, and a lookup walks
clockwise to the first point owned by a current candidate. Because a backend's points
depend only on its name, that is exactly the ring built over the candidates alone, so
an unhealthy primary or a retry that excludes it sends the session to the next backend
on the ring, without building a ring per candidate set (a rebuild at 512 backends
costs tens of ms, which a retry must not pay).
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Collection, Mapping
from typing import ClassVar

from pydantic import BaseModel, Field

from policies.base import PARAMS_CONFIG, register
from policies.load_helpers import CandidatesByName, LeastInflight
from proxy.types import Backend, ClusterView, Decision, Outcome, Prediction, RequestContext

_EIGHT_U64 = struct.Struct(">8Q")
STALE_FACTOR = 4  # rebuild when the ring holds this many times more backends than live


class SessionParams(BaseModel):
    model_config = PARAMS_CONFIG
    virtual_nodes: int = Field(100, ge=1, description="ring points per backend")


def stable_hash(key: str) -> int:
    """Same on every replica and every run (unlike Python's salted `hash`)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def ring_points(name: str, count: int) -> list[int]:
    """`count` stable 64-bit ring positions of backend `name` (8 per blake2b digest)."""
    points: list[int] = []
    for chunk in range((count + 7) // 8):
        points.extend(_EIGHT_U64.unpack(hashlib.blake2b(f"{name}#{chunk}".encode()).digest()))
    return points[:count]


class _Ring:
    __slots__ = ("names", "owners", "points")

    def __init__(self, names: Collection[str], virtual_nodes: int) -> None:
        positions: list[int] = []
        owner_of: list[str] = []
        for name in sorted(names):  # sorted + stable sort: ties break the same everywhere
            positions.extend(ring_points(name, virtual_nodes))
            owner_of.extend([name] * virtual_nodes)
        order = sorted(range(len(positions)), key=positions.__getitem__)
        self.names = frozenset(names)
        self.points = [positions[i] for i in order]
        self.owners = [owner_of[i] for i in order]

    def lookup(self, key: str, candidates: Mapping[str, Backend]) -> Backend:
        """The first backend clockwise of `key` that is among `candidates`."""
        owners = self.owners
        start = bisect.bisect(self.points, stable_hash(key))
        for at in range(start, start + len(owners)):
            backend = candidates.get(owners[at % len(owners)])
            if backend is not None:
                return backend
        raise LookupError("no candidate on the ring")  # callers keep candidates ⊆ names


@register
class Session:
    name: ClassVar[str] = "session"
    Params: ClassVar[type[BaseModel]] = SessionParams

    def __init__(self, params: SessionParams) -> None:
        self._params = params
        self._rings: dict[str, _Ring] = {}  # model -> ring over its backends seen so far
        self._checked: dict[str, dict[str, Backend]] = {}  # model -> candidates ring covers
        self._by_name = CandidatesByName()
        self._least = LeastInflight()

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        if not ctx.session:
            backend, load = self._least.pick(view)
            return Decision(backend, f"no session; least in-flight {load}")
        candidates = self._by_name(view.candidates)
        backend = self._ring(ctx.model, candidates).lookup(ctx.session, candidates)
        return Decision(backend, "session affinity")

    def observe(self, outcome: Outcome) -> None:
        pass

    def _ring(self, model: str, candidates: dict[str, Backend]) -> _Ring:
        ring = self._rings.get(model)
        if ring is not None and self._checked.get(model) is candidates:
            return ring  # the common case: same candidates as last time
        if ring is None or len(ring.names) > STALE_FACTOR * len(candidates):
            ring = _Ring(candidates.keys(), self._params.virtual_nodes)
        elif not ring.names.issuperset(candidates):
            ring = _Ring(ring.names | candidates.keys(), self._params.virtual_nodes)
        self._rings[model] = ring
        self._checked[model] = candidates
        return ring
