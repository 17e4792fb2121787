"""Load helpers shared by several policies."""

from __future__ import annotations

from proxy.types import Backend, ClusterView


class LeastInflight:
    """Pick the candidate with the fewest open requests via this proxy.

    Ties take turns: a fixed tie-break would pile every burst onto one backend.
    """

    __slots__ = ("_turn",)

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, view: ClusterView) -> tuple[Backend, int]:
        inflight = view.inflight
        loads = [inflight.get(b.name, 0) for b in view.candidates]
        least = min(loads)
        tied = [b for b, load in zip(view.candidates, loads, strict=True) if load == least]
        self._turn += 1
        return tied[self._turn % len(tied)], least
