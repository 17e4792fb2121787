"""The embedded default: one process, nothing to share, counters kept here."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from proxy.state.base import Inbox, Outbox


class MemoryStore:
    name = "memory"

    def __init__(self) -> None:
        self._counters: dict[str, float] = {}

    async def exchange(self, outbox: Outbox, counters: Collection[str]) -> Inbox:
        totals = self._counters
        for key, amount in outbox.counters.items():
            totals[key] = totals.get(key, 0.0) + amount
        wanted = set(counters)
        for key in [k for k in totals if k not in wanted]:
            del totals[key]  # a counter nobody asks for any more (an old window)
        return Inbox(counters={k: totals.get(k, 0.0) for k in wanted})

    async def api_keys(self) -> dict[str, dict[str, Any]]:
        return {}

    async def lease_slots(self, limit: int, needs: Mapping[str, tuple[int, int]],
                          cap: int | None = None) -> dict[str, int]:
        return dict.fromkeys(needs, limit if cap is None else min(limit, cap))  # the only replica

    async def close(self) -> None:
        pass
