"""Scrape every backend's vLLM `/metrics` concurrently and publish frozen snapshots.

A backend is healthy once a scrape succeeds. It turns unhealthy after
`unhealthy_after` consecutive failed scrapes, or at once when the relay reports a
connection failure; an unhealthy backend is probed again with exponential backoff.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace

import aiohttp

from proxy.config import PollerConfig
from proxy.registry import Registry
from proxy.types import UNKNOWN_STATS, Backend, BackendStats
from proxy.vllm_metrics import Cumulative, parse_samples, to_stats

log = logging.getLogger("laneway.poller")


@dataclass(slots=True)
class _Health:
    failures: int = 0
    backoff_s: float = 0.0
    next_probe_at: float = 0.0
    cumulative: Cumulative = field(default_factory=Cumulative)


class Poller:
    def __init__(self, registry: Registry, cfg: PollerConfig, session: aiohttp.ClientSession):
        self._registry = registry
        self._cfg = cfg
        self._session = session
        self._health: dict[str, _Health] = {}
        self._timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        self.last_poll_s: float = 0.0  # duration of the last round, for metrics

    async def run(self) -> None:
        """Poll forever at the configured interval (cancel to stop)."""
        while True:
            started = time.monotonic()
            await self.poll_once()
            self.last_poll_s = time.monotonic() - started
            await asyncio.sleep(max(0.0, self._cfg.interval_s - self.last_poll_s))

    async def poll_once(self) -> None:
        now = time.monotonic()
        due = [b for b in self._registry.all() if self._state(b.name).next_probe_at <= now]
        if not due:
            return
        texts = await asyncio.gather(*(self._scrape(b) for b in due))
        snapshot = dict(self._registry.stats)
        for backend, text in zip(due, texts, strict=True):
            snapshot[backend.name] = self._next_stats(backend, text, snapshot, now)
        known = {b.name for b in self._registry.all()}
        self._registry.publish({k: v for k, v in snapshot.items() if k in known})

    def report_failure(self, name: str, why: str) -> None:
        """The relay could not reach `name`: stop routing there until a probe succeeds."""
        state = self._state(name)
        last = self._registry.stats.get(name, UNKNOWN_STATS)
        if last.healthy:
            log.warning("backend %s marked unhealthy: %s", name, why)
            snapshot = dict(self._registry.stats)
            snapshot[name] = replace(last, healthy=False)
            self._registry.publish(snapshot)
        self._back_off(state, time.monotonic())

    def _state(self, name: str) -> _Health:
        state = self._health.get(name)
        if state is None:
            state = self._health[name] = _Health()
        return state

    async def _scrape(self, backend: Backend) -> str | None:
        try:
            async with self._session.get(
                f"{backend.url}/metrics", timeout=self._timeout
            ) as resp:
                if resp.status != 200:
                    return None
                return await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    def _next_stats(
        self, backend: Backend, text: str | None, snapshot: dict[str, BackendStats], now: float
    ) -> BackendStats:
        state = self._state(backend.name)
        last = snapshot.get(backend.name, UNKNOWN_STATS)
        if text is not None:
            if not last.healthy:
                log.info("backend %s is healthy", backend.name)
            stats, state.cumulative = to_stats(parse_samples(text), state.cumulative, last, now)
            state.failures, state.backoff_s, state.next_probe_at = 0, 0.0, now
            return stats
        state.failures += 1
        if last.healthy and state.failures < self._cfg.unhealthy_after:
            return last  # one missed scrape is not an outage
        if last.healthy:
            log.warning("backend %s unhealthy after %d failed scrapes", backend.name,
                        state.failures)
        self._back_off(state, now)
        return replace(last, healthy=False)

    def _back_off(self, state: _Health, now: float) -> None:
        state.backoff_s = min(
            max(state.backoff_s * 2, self._cfg.backoff_initial_s), self._cfg.backoff_max_s
        )
        state.next_probe_at = now + state.backoff_s
