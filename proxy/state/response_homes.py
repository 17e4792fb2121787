"""Which backend holds each stored response of the Responses API (proxy/http/stored_responses.py).

Bounded, least recently used out first; what this replica learns is handed to the
replicator (table `responses`, proxy/state/replicator.py) and what the others learned
comes back through it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class ResponseHomes:
    """response id -> the name of the backend that made it, for the last `capacity` ids.

    What this replica learns is also kept for the replicator (`export_updates`, at most
    `capacity` between two syncs); what the others learned comes in by `merge_updates`.
    """

    def __init__(self, capacity: int = 100_000) -> None:
        self._homes: OrderedDict[str, str] = OrderedDict()
        self._capacity = capacity
        self._learned: list[tuple[str, str]] = []  # since the last export

    def learn(self, response_id: str, backend: str) -> None:
        self._remember(response_id, backend)
        self._learned.append((response_id, backend))
        if len(self._learned) > self._capacity:
            del self._learned[:-self._capacity]

    def _remember(self, response_id: str, backend: str) -> None:
        self._homes[response_id] = backend
        self._homes.move_to_end(response_id)
        if len(self._homes) > self._capacity:
            self._homes.popitem(last=False)

    def export_updates(self) -> list[Any]:
        """The homes learned here since the last call, as `[id, backend]` pairs."""
        learned, self._learned = self._learned, []
        return [list(pair) for pair in learned]

    def merge_updates(self, updates: list[Any]) -> None:
        """Remember the homes another replica learned (malformed writes are skipped)."""
        for write in updates:
            if (isinstance(write, list) and len(write) == 2
                    and all(isinstance(part, str) for part in write)):
                self._remember(write[0], write[1])

    def get(self, response_id: str) -> str | None:
        home = self._homes.get(response_id)
        if home is not None:
            self._homes.move_to_end(response_id)
        return home

    def __len__(self) -> int:
        return len(self._homes)
