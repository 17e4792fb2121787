"""The requests with a deadline that a policy routed and has not seen finish, by the
backend they run on now: goodput's `protect` reads them to price what one more
admission does to the requests already on a backend.

Each entry is a deadline on the proxy's monotonic clock, the predicted answer length
(re-estimated at every τ-token check) and the last count of generated tokens with
the time it was counted. The entry follows the request when it moves (the move's
`pick`, the τ check's decision, a leg's `Outcome.moved_to`) and is dropped when its
final outcome arrives; a bound on the entries keeps streams whose outcome never came
from piling up. They are this replica's own: with several proxy replicas each protects
the requests it routed (the in-flight counts it prices the load with are shared).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(slots=True)
class Placed:
    request_id: str
    backend: str
    deadline_at: float  # arrival + D_r
    output_tokens: float  # predicted L_out
    max_tokens: int | None
    generated: int = 0
    counted_at: float = 0.0  # when `generated` was counted (at placement: decode's start)


class Placements:
    def __init__(self, limit: int = 100_000) -> None:
        self._limit = limit
        self._by_id: OrderedDict[str, Placed] = OrderedDict()
        self._by_backend: dict[str, dict[str, Placed]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def place(self, placed: Placed) -> None:
        """A new request, or one that moves (its count so far is kept)."""
        old = self._by_id.get(placed.request_id)
        if old is not None:
            self.move(old.request_id, placed.backend)
            return
        self._by_id[placed.request_id] = placed
        self._by_backend.setdefault(placed.backend, {})[placed.request_id] = placed
        while len(self._by_id) > self._limit:
            self.finish(next(iter(self._by_id)))

    def move(self, request_id: str, backend: str) -> None:
        placed = self._by_id.get(request_id)
        if placed is None or placed.backend == backend:
            return
        self._by_backend[placed.backend].pop(request_id, None)
        placed.backend = backend
        self._by_backend.setdefault(backend, {})[request_id] = placed

    def progress(self, request_id: str, backend: str, generated: int, at: float,
                 output_tokens: float) -> None:
        placed = self._by_id.get(request_id)
        if placed is None:
            return
        self.move(request_id, backend)
        placed.generated, placed.counted_at = generated, at
        placed.output_tokens = output_tokens

    def finish(self, request_id: str) -> None:
        placed = self._by_id.pop(request_id, None)
        if placed is not None:
            self._by_backend[placed.backend].pop(request_id, None)

    def on(self, backend: str) -> Iterator[Placed]:
        return iter(self._by_backend.get(backend, {}).values())
