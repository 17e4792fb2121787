"""What proxy replicas share, as one exchange per sync tick.

The request path never waits for a store: policies, the rate limiter and the
registry keep local mirrors, and `Replicator` (proxy/state/replicator.py) trades
what this replica wrote since the last tick (an `Outbox`) for what the others
wrote (an `Inbox`) every `state.sync_interval_s`.

Three kinds of state, three merge rules:
* tables (prefix index, EMA speeds, stored responses' homes): an append-only log of
  JSON-able writes per table; each replica applies the others' writes to its own copy;
* counters (rate-limit windows): sums; a replica adds its increments and reads back
  the cluster totals;
* in-flight counts: each replica's own counts, which expire `inflight_ttl_s` after
  the replica stopped refreshing them (so a crashed replica's counts vanish).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol


class StoreUnavailable(Exception):
    """The shared store could not be reached; the caller keeps its local state."""


@dataclass(slots=True)
class Outbox:
    """What this replica tells the others in one exchange."""

    entries: dict[str, list[Any]] = field(default_factory=dict)  # table -> new writes
    counters: dict[str, float] = field(default_factory=dict)  # counter -> amount added
    inflight: dict[str, int] = field(default_factory=dict)  # backend -> open here


@dataclass(slots=True)
class Inbox:
    """What the others wrote, as one exchange returns it."""

    entries: dict[str, list[Any]] = field(default_factory=dict)  # table -> their writes
    counters: dict[str, float] = field(default_factory=dict)  # counter -> cluster total
    inflight: dict[str, int] = field(default_factory=dict)  # backend -> open elsewhere
    replicas: int = 1  # live replicas, this one included


class Store(Protocol):
    """A shared store: in-memory (one process) or Redis (every replica)."""

    name: str

    async def exchange(self, outbox: Outbox, counters: Collection[str]) -> Inbox:
        """Publish `outbox`; return the others' news and the totals of `counters`.

        Raises `StoreUnavailable`; then nothing of `outbox` was applied for sure, and
        the caller sends it again next time (counter increments are not idempotent,
        so an exchange that fails after Redis applied it may count twice: at most one
        tick's increments, on the safe side for limits)."""
        ...

    async def api_keys(self) -> dict[str, dict[str, Any]]:
        """Client keys kept in the store: sha256 hex -> key settings."""
        ...

    async def close(self) -> None: ...
