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
  the replica stopped refreshing them (so a crashed replica's counts vanish);
* slot leases (strict flow control): how many requests each replica may have open on
  each backend, granted atomically so that the replicas' leases never add up to more
  than the limit (`Store.lease_slots`);
* flow-control modes: each replica's (strict or not, and its limit), so that replicas
  that do not hold the same limit the same way are told (the leases hold the limit only
  when every replica leases, and for the limit each asks for).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
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
    flow: str = ""  # this replica's flow-control mode (`Leasing.flow_mode`); "": none


@dataclass(slots=True)
class Inbox:
    """What the others wrote, as one exchange returns it."""

    entries: dict[str, list[Any]] = field(default_factory=dict)  # table -> their writes
    counters: dict[str, float] = field(default_factory=dict)  # counter -> cluster total
    inflight: dict[str, int] = field(default_factory=dict)  # backend -> open elsewhere
    replicas: int = 1  # live replicas, this one included
    # The store had no record of this replica before this exchange: a new replica, a
    # store that lost its data (e.g. Redis restarted without persistence), or this
    # replica silent for longer than inflight_ttl_s.
    rejoined: bool = False
    flows: dict[str, int] = field(default_factory=dict)  # flow mode -> live replicas in it


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

    async def lease_slots(self, limit: int, needs: Mapping[str, tuple[int, int]],
                          cap: int | None = None) -> dict[str, int]:
        """This replica's slots on each backend of `needs` (backend -> (what it holds
        there: its current lease, or its open requests if more; its open requests plus
        the ones waiting that it could take)), out of `limit` per backend for all the
        replicas, and at most `cap` each when given.

        Granted atomically: what the live replicas hold on a backend (each its lease,
        or its open requests while they are more) never adds up to more than `limit`.
        While the replicas together need at most `limit`, each is granted its need and
        an equal part of the rest; beyond it, a part of `limit` in proportion to its
        need, as far as the others' holdings leave room (they shrink as their requests
        end). Raises `StoreUnavailable`."""
        ...

    async def close(self) -> None: ...


def equal_share(limit: int, replicas: int) -> int:
    """An equal part of `limit` for each of `replicas` (at least one slot): what strict
    flow control keeps to while the store cannot say what the others hold."""
    return max(1, limit // max(1, replicas))


class Leasing(Protocol):
    """Who leases backend slots at each sync: strict flow control
    (proxy/admission/flow_control.py)."""

    on_short: Callable[[], None] | None  # set by the sync: call it to lease sooner

    def lease_needs(self) -> tuple[int, dict[str, tuple[int, int]]] | None: ...

    def leased(self, grants: Mapping[str, int]) -> None: ...

    def lease_lost(self, replicas: int) -> None: ...

    def flow_mode(self) -> str:
        """This replica's flow control as the others must share it, e.g. "strict, 4
        per backend", "loose, 4 per backend" or "off"."""
        ...
