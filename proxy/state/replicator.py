"""The background task that keeps this replica's mirrors in step with the others'.

Every `state.sync_interval_s` it trades, in one exchange with the store, what this
replica wrote (table writes: the policy's and fixed tables such as the stored
responses' homes; rate-limit increments; its in-flight counts) for what the others
wrote. Nothing on the request path waits for it. When the store is
unreachable the proxy keeps serving on local state: writes and increments are kept
(bounded) and sent once it is back, the others' in-flight counts are dropped after
`inflight_ttl_s` (as the others drop ours), and the outage is logged once and counted
in `laneway_state_sync_failures_total` / `laneway_state_connected`.

With strict flow control the same tick renews this replica's slot leases; a request
that finds none free asks for a sync at once (at most one per `_MIN_GAP` of the
interval), so that it need not wait a whole interval for slots the others left free.
Unreachable for longer than `inflight_ttl_s`, or since start, it keeps to an equal
share of each limit (`lease_lost`); so it does for `inflight_ttl_s` after finding that
the store lost it (emptied: what the others hold is not there until each has synced).
Replicas whose flow control differs (strict or not, or the limit) are told at once: a
warning naming each mode and how many replicas run it, and `laneway_state_flow_modes`
above 1; no lease holds the limit then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from policies.base import Policy, Replicated
from proxy.config import StateConfig
from proxy.fleet.registry import Registry
from proxy.observability.metrics import Metrics
from proxy.state.base import Leasing, Outbox, Store, StoreUnavailable, equal_share
from proxy.state.rate_counters import WindowCounters

log = logging.getLogger("laneway.state")
MAX_UNSENT = 20_000  # table writes kept across an outage (the oldest are dropped)
KEYS_EVERY_S = 2.0  # API keys kept in the store are re-read this often
_MIN_GAP = 0.2  # an early sync (strict flow control) comes this part of an interval
# at the soonest after the last one


class Replicator:
    def __init__(self, store: Store, cfg: StateConfig, registry: Registry,
                 counters: WindowCounters, metrics: Metrics,
                 policy: Callable[[], Policy],
                 on_keys: Callable[[dict[str, dict[str, Any]]], None] | None = None,
                 tables: Mapping[str, Replicated] | None = None,
                 leasing: Leasing | None = None) -> None:
        """`policy`: the current policy (its table is `policy:<name>` when it is
        `Replicated`); `tables`: the other shared mirrors, by table name; `leasing`:
        strict flow control's slot leases, renewed at each sync."""
        self.store, self._cfg, self._registry = store, cfg, registry
        self._counters, self._metrics, self._policy = counters, metrics, policy
        self._on_keys = on_keys
        self._tables = dict(tables or {})
        self._unsent: dict[str, list[Any]] = {}
        self._last_ok: float | None = None  # the last exchange that went through
        self._keys_read_at = -KEYS_EVERY_S
        self.connected: bool | None = None  # None until the first exchange
        self.replicas = 1
        self._leasing = leasing
        self._flows: dict[str, int] = {}  # flow mode -> live replicas, as last seen
        # (when, the replicas seen before) the store was found to have lost this
        # replica: leases keep to an equal share until inflight_ttl_s later
        self._rejoined: tuple[float, int] | None = None
        self._soon = asyncio.Event()
        if leasing is not None:
            leasing.on_short = self._soon.set

    async def run(self) -> None:
        """Sync forever (cancel to stop); back off to 1 s while the store is down."""
        interval = self._cfg.sync_interval_s
        while True:
            self._soon.clear()
            if not await self.sync_once():
                await asyncio.sleep(max(interval, 1.0))
                continue
            await asyncio.sleep(interval * _MIN_GAP)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval * (1 - _MIN_GAP)):
                    await self._soon.wait()

    async def sync_once(self) -> bool:
        tables = self._current_tables()
        for table, mirror in tables.items():
            self._queue(table, mirror.export_updates())
        outbox = Outbox(entries=self._unsent, counters=self._counters.outgoing(),
                        inflight={k: v for k, v in self._registry.local_inflight.items() if v},
                        flow=self._leasing.flow_mode() if self._leasing is not None else "")
        started = time.monotonic()
        try:
            inbox = await self.store.exchange(outbox, self._counters.wanted(time.time()))
        except StoreUnavailable as exc:
            self._failed(exc)
            return False
        self._unsent = {}  # applied: a failure below must not send it twice
        if inbox.rejoined and self._last_ok is not None:
            self._lost_by_store(inbox.replicas)
        self._last_ok = time.monotonic()
        self._counters.confirm(inbox.counters)
        self._registry.set_remote_inflight(inbox.inflight)
        for table, mirror in tables.items():
            if inbox.entries.get(table):
                mirror.merge_updates(inbox.entries[table])
        self.replicas = inbox.replicas
        self._metrics.state_replicas.set(inbox.replicas)
        self._compare_flows(inbox.flows)
        try:
            await self._read_keys(started)
            await self._lease()  # with the replicas' count and liveness just refreshed
        except StoreUnavailable as exc:
            self._failed(exc)
            return False
        self._metrics.state_sync.observe(time.monotonic() - started)
        self._set_connected(True, "")
        return True

    def _compare_flows(self, flows: dict[str, int]) -> None:
        """Warn when the live replicas' flow control differs (once per change), and say
        when it agrees again."""
        self._metrics.state_flow_modes.set(len(flows))
        if flows == self._flows:
            return
        if len(flows) > 1:
            log.warning("replicas differ in flow control, so no replica holds the limit "
                        "for all: %s (set flow_control.strict and max_inflight_per_backend "
                        "alike on every replica)",
                        "; ".join(f"{mode} ({n} replica{'s' if n > 1 else ''})"
                                  for mode, n in sorted(flows.items())))
        elif len(self._flows) > 1:
            log.info("replicas agree on flow control again: %s", ", ".join(flows) or "none")
        self._flows = dict(flows)

    def _current_tables(self) -> dict[str, Replicated]:
        policy = self._policy()
        if isinstance(policy, Replicated):
            return {f"policy:{policy.name}": policy, **self._tables}
        return self._tables

    def _lost_by_store(self, replicas: int) -> None:
        """The store had no record of this replica: emptied (e.g. Redis restarted
        without its data), or this replica was silent longer than inflight_ttl_s. The
        others' holdings are missing from it until each has synced again, so a lease
        by the store alone could grant slots they hold: keep to an equal share of the
        replicas seen before (or now, if more) until inflight_ttl_s has passed."""
        before = max(self.replicas, replicas)
        self._rejoined = (time.monotonic(), before)
        strict = self._leasing is not None and self._leasing.lease_needs() is not None
        log.warning("shared state (%s) had lost this replica (emptied, or this replica "
                    "was silent longer than state.inflight_ttl_s)%s", self.store.name,
                    f"; strict flow control keeps to an equal part of each limit "
                    f"({before} replicas) for {self._cfg.inflight_ttl_s:g} s, until the "
                    f"others' holdings are back in it" if strict else "")

    async def _lease(self) -> None:
        if self._leasing is None or (needs := self._leasing.lease_needs()) is None:
            return
        limit, wanted = needs
        cap = None
        if self._rejoined is not None:
            since, replicas = self._rejoined
            if time.monotonic() - since <= self._cfg.inflight_ttl_s:
                cap = equal_share(limit, replicas)
            else:
                self._rejoined = None
                log.info("strict flow control: leasing from the shared state (%s) again",
                         self.store.name)
        self._leasing.leased(await self.store.lease_slots(limit, wanted, cap))

    async def _read_keys(self, now: float) -> None:
        if self._on_keys is not None and now - self._keys_read_at >= KEYS_EVERY_S:
            self._on_keys(await self.store.api_keys())
            self._keys_read_at = now

    def _queue(self, table: str, writes: list[Any]) -> None:
        if not writes:
            return
        queued = self._unsent.setdefault(table, [])
        queued.extend(writes)
        del queued[:-MAX_UNSENT]

    def _failed(self, exc: StoreUnavailable) -> None:
        self._metrics.state_failures.inc()
        # The others dropped this replica's leases (or never saw it: nothing to wait for).
        if self._last_ok is None \
                or time.monotonic() - self._last_ok > self._cfg.inflight_ttl_s:
            self._registry.set_remote_inflight({})  # as stale as ours are to them
            if self._leasing is not None:
                self._leasing.lease_lost(self.replicas)
        self._set_connected(False, str(exc))

    def _set_connected(self, up: bool, why: str) -> None:
        if up != self.connected:
            if up:
                log.info("shared state (%s) connected", self.store.name)
            else:
                log.warning("shared state (%s) unreachable, serving on local state: %s",
                            self.store.name, why)
        self.connected = up
        self._metrics.state_connected.set(1 if up else 0)
