"""The tracked streams running on each backend, so a drain can ask them to move.

The runtime owns one; every tracked relay (proxy/migration/tracked_relay.py) registers
itself while it streams, and a drain or a removal (proxy/reconfigure.py) asks the
streams of a backend to move.
"""

from __future__ import annotations

from typing import Protocol


class Movable(Protocol):
    def request_move(self, reason: str) -> None: ...


class ActiveStreams:
    """Tracked streams by the backend they run on, so a drain can move them; and the
    backends seen streaming reasoning deltas (a server with a reasoning parser), whose
    streams stay put even before their first delta (later requests there are not
    tracked at all: proxy/http/generation_routes.py)."""

    def __init__(self) -> None:
        self._by_backend: dict[str, set[Movable]] = {}
        self.reasoning: set[str] = set()

    def track(self, backend: str, stream: Movable) -> None:
        self._by_backend.setdefault(backend, set()).add(stream)

    def untrack(self, backend: str, stream: Movable) -> None:
        self._by_backend.get(backend, set()).discard(stream)

    def count(self, backend: str) -> int:
        return len(self._by_backend.get(backend, ()))

    def move_all(self, backend: str, reason: str) -> int:
        """Ask every tracked stream on `backend` to move; returns how many were asked."""
        streams = list(self._by_backend.get(backend, ()))
        for stream in streams:
            stream.request_move(reason)
        return len(streams)
