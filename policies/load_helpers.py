"""Load helpers shared by several policies.

These run once per pick over every candidate, so they keep the per-candidate work to
one mapping lookup and leave min/count/index to C (see `bench/studies/policy_latency.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import TYPE_CHECKING

from proxy.types import Backend, ClusterView

if TYPE_CHECKING:
    from _typeshed import SupportsRichComparison


class RotatingArgmin:
    """Index of the smallest key; ties take turns.

    A fixed tie-break (always the first) would pile every burst that arrives between
    two load updates onto one backend.
    """

    __slots__ = ("_turn",)

    def __init__(self) -> None:
        self._turn = 0

    def __call__(self, keys: Sequence[SupportsRichComparison]) -> int:
        least = min(keys)
        at = keys.index(least)
        ties = keys.count(least)
        if ties > 1:
            self._turn += 1
            for _ in range(self._turn % ties):
                at = keys.index(least, at + 1)
        return at


def candidate_names(view: ClusterView) -> list[str]:
    return [b.name for b in view.candidates]


def inflight_loads(view: ClusterView, names: list[str] | None = None) -> list[int]:
    """The proxy's open requests on each candidate, in candidate order."""
    return list(map(view.inflight.get, names or candidate_names(view), repeat(0)))


class LeastInflight:
    """Pick the candidate with the fewest open requests via this proxy."""

    __slots__ = ("_argmin",)

    def __init__(self) -> None:
        self._argmin = RotatingArgmin()

    def pick(self, view: ClusterView) -> tuple[Backend, int]:
        loads = inflight_loads(view)
        at = self._argmin(loads)
        return view.candidates[at], loads[at]


class CandidatesByName:
    """`{name: backend}` of the candidates, rebuilt only when the tuple changes.

    The registry hands out the same candidates tuple until health or config changes,
    so an identity check saves an O(N) dict build on almost every pick. Holding the
    tuple keeps its id from being reused.
    """

    __slots__ = ("_by_name", "_candidates")

    def __init__(self) -> None:
        self._candidates: tuple[Backend, ...] = ()
        self._by_name: dict[str, Backend] = {}

    def __call__(self, candidates: tuple[Backend, ...]) -> dict[str, Backend]:
        if candidates is not self._candidates:
            self._by_name = {b.name: b for b in candidates}
            self._candidates = candidates
        return self._by_name
