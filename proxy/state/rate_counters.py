"""Per-minute counters for rate limits, shared by replicas without waiting for them.

A limit is checked against a sliding-window estimate over two fixed one-minute windows
(`previous * (1 - elapsed fraction) + current`, as Cloudflare and NGINX do it), read
from the local mirror: the cluster totals of the last sync plus what this replica
added since. The replicator (proxy/state/replicator.py) ships local increments to the
store and brings back the totals every `state.sync_interval_s`, so replicas may
together overshoot a limit by what the others admitted within one sync interval.
"""

from __future__ import annotations

import math

WINDOW_S = 60
_EPS = 1e-9  # float noise of the window fractions


class WindowCounters:
    """Counter key -> amount; every key names one minute window."""

    def __init__(self) -> None:
        self._totals: dict[str, float] = {}  # cluster totals at the last sync
        self._pending: dict[str, float] = {}  # added here, not yet handed to the store
        self._sending: dict[str, float] = {}  # handed to the store, not confirmed yet
        self._windows: dict[str, int] = {}  # key -> its window, to know what to read back

    def value(self, key: str) -> float:
        return (self._totals.get(key, 0.0) + self._pending.get(key, 0.0)
                + self._sending.get(key, 0.0))

    def add(self, key: str, window: int, amount: float) -> None:
        self._pending[key] = self._pending.get(key, 0.0) + amount
        self._windows[key] = window

    def outgoing(self) -> dict[str, float]:
        """Increments to publish now: everything not confirmed yet (resent after a
        failed exchange)."""
        for key, amount in self._pending.items():
            self._sending[key] = self._sending.get(key, 0.0) + amount
        self._pending.clear()
        return dict(self._sending)

    def confirm(self, totals: dict[str, float]) -> None:
        """The exchange of `outgoing()` succeeded; `totals` are the cluster's now."""
        self._sending.clear()
        self._totals = totals

    def wanted(self, now: float) -> list[str]:
        """Keys worth reading back: the current and the previous window."""
        oldest = int(now // WINDOW_S) - 1
        for key in [k for k, w in self._windows.items() if w < oldest]:
            del self._windows[key]
        return list(self._windows)


class RateLimiter:
    def __init__(self, counters: WindowCounters) -> None:
        self.counters = counters

    def used(self, subject: str, now: float) -> float:
        """Sliding-window estimate of what `subject` (e.g. `team-a:requests`) used."""
        window, frac = divmod(now / WINDOW_S, 1.0)
        current = self.counters.value(_key(subject, int(window)))
        previous = self.counters.value(_key(subject, int(window) - 1))
        return previous * (1.0 - frac) + current

    def retry_after(self, subject: str, cost: float, limit: float, now: float) -> int | None:
        """None if `cost` more fits under `limit`, else whole seconds until it would
        (assuming nothing else is admitted meanwhile; at most two windows)."""
        if self.used(subject, now) + cost <= limit + _EPS:
            return None
        window = int(now // WINDOW_S)
        current = self.counters.value(_key(subject, window))
        previous = self.counters.value(_key(subject, window - 1))
        for wait in range(1, 2 * WINDOW_S + 1):
            later = now + wait
            later_window, frac = divmod(later / WINDOW_S, 1.0)
            if later_window == window:
                used = previous * (1.0 - frac) + current
            elif later_window == window + 1:
                used = current * (1.0 - frac)
            else:
                used = 0.0
            if used + cost <= limit + _EPS:
                return wait
        return 2 * WINDOW_S

    def charge(self, subject: str, amount: float, window: int) -> None:
        self.counters.add(_key(subject, window), window, amount)


def window_of(now: float) -> int:
    return math.floor(now / WINDOW_S)


def _key(subject: str, window: int) -> str:
    return f"rl:{subject}:{window}"
