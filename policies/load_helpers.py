"""Load helpers shared by several policies.

These run once per pick over every candidate, so they keep the per-candidate work to
one mapping lookup and leave min/count/index to C (see `bench/studies/policy_latency.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import TYPE_CHECKING

from proxy.types import Backend, ClusterView, Decision

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


class CacheOrLeast:
    """The cache-aware policies' last step: their best-cached backend, or the least
    loaded when the match is too short or the best is overloaded.

    The guard follows SGLang's cache-aware router (`balance_abs_threshold`,
    `balance_rel_threshold`; see policies/prefix_aware.py for where it differs): the
    best is overloaded when both its in-flight gap to the least loaded and its ratio to
    `least + 1` exceed them. `match` describes the match in the decision's reason.
    """

    __slots__ = ("_abs", "_least", "_rel")

    def __init__(self, balance_abs_threshold: int, balance_rel_threshold: float) -> None:
        self._abs, self._rel = balance_abs_threshold, balance_rel_threshold
        self._least = LeastInflight()

    def choose(self, view: ClusterView, best: Backend | None, match: str,
               long_enough: bool) -> Decision:
        least, least_load = self._least.pick(view)
        if best is None or not long_enough:
            return Decision(least, f"{match}, too short; least in-flight {least_load}")
        best_load = view.inflight_of(best)
        if best_load - least_load > self._abs and best_load > self._rel * (least_load + 1):
            return Decision(least, f"{match} on {best.name}, overloaded "
                                   f"({best_load} vs {least_load}); least in-flight")
        return Decision(best, f"{match} on {best.name}")


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
