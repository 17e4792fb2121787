"""Scrape every backend's vLLM `/metrics` and publish frozen snapshots.

Every `interval_s` the poller starts a scrape of each backend that is due and not
still being scraped, and publishes each answer as it arrives (a few ms of coalescing),
stamped with its own arrival time: one slow or hung backend delays nobody else's
stats, and a policy sees each backend's state as of its latest answer, not as of the
end of a round over the whole fleet.

A backend is healthy once a scrape succeeds. It turns unhealthy after
`unhealthy_after` consecutive failed scrapes, or at once when the relay reports a
connection failure; an unhealthy backend is probed again with exponential backoff.
One ejected by passive health (proxy/fleet/outliers.py) stays unhealthy until its ejection
ends, however its scrapes go; its first good scrape after that brings it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import time
from dataclasses import dataclass, field, replace

from proxy.config import PollerConfig
from proxy.fleet.registry import Registry
from proxy.fleet.scrape import Scraper
from proxy.fleet.vllm_metrics import WANTED, Cumulative, parse_samples, to_stats
from proxy.types import UNKNOWN_STATS, Backend, BackendStats

log = logging.getLogger("laneway.poller")

_COALESCE_S = 0.002  # answers arriving within this are published together


@dataclass(slots=True)
class _Health:
    failures: int = 0
    backoff_s: float = 0.0
    next_probe_at: float = 0.0
    ejected_until: float = 0.0
    cumulative: Cumulative = field(default_factory=Cumulative)


class Poller:
    def __init__(self, registry: Registry, cfg: PollerConfig,
                 tls: ssl.SSLContext | None = None) -> None:
        """`tls`: the https backends' CA (None: the system's)."""
        self._registry = registry
        self._cfg = cfg
        self.scraper = Scraper(cfg.timeout_s, WANTED if cfg.filter_families else (), tls)
        self._health: dict[str, _Health] = {}
        self._scraping: set[str] = set()
        self._arrived: dict[str, BackendStats] = {}  # not yet published
        self._flush_at: asyncio.TimerHandle | None = None
        self._all_answered = asyncio.Event()
        self.last_poll_s: float = 0.0  # start of a round to its last answer (or interval)
        self.scrapes = 0  # answered or failed, since start

    async def run(self) -> None:
        """Poll forever at the configured interval (cancel to stop)."""
        interval = self._cfg.interval_s
        try:
            while True:
                started = time.monotonic()
                self.scraper.expire(asyncio.get_running_loop().time())
                self.scraper.forget((b.name, b.url) for b in self._registry.all())
                self._start_due(started)
                # A backend still unanswered at the next tick is skipped then.
                await self._answers(interval)
                self.last_poll_s = time.monotonic() - started
                await asyncio.sleep(max(0.0, interval - self.last_poll_s))
        finally:
            await self.scraper.close()

    async def poll_once(self) -> None:
        """Scrape every due backend and publish once all have answered (or timed out)."""
        self._start_due(time.monotonic())
        await self._answers(self._cfg.timeout_s)
        self.scraper.expire(asyncio.get_running_loop().time() + self._cfg.timeout_s)
        self._flush()

    def report_failure(self, name: str, why: str) -> None:
        """The relay could not reach `name`: stop routing there until a probe succeeds."""
        if self._take_out(name):
            log.warning("backend %s marked unhealthy: %s", name, why)
        self._back_off(self._state(name), time.monotonic())

    def eject(self, name: str, for_s: float) -> None:
        """Passive health: route nothing to `name` for `for_s`, though it answers its
        scrapes."""
        state = self._state(name)
        state.ejected_until = state.next_probe_at = time.monotonic() + for_s
        self._take_out(name)

    def _take_out(self, name: str) -> bool:
        """Publish `name` unhealthy now (its latest stats otherwise); whether it was
        healthy."""
        last = self._arrived.get(name) or self._registry.stats.get(name, UNKNOWN_STATS)
        if not last.healthy:
            return False
        self._arrived[name] = replace(last, healthy=False)
        self._flush()
        return True

    def readmit(self, name: str) -> None:
        """End `name`'s ejection: healthy again on its next good scrape, due now."""
        state = self._state(name)
        state.ejected_until = state.next_probe_at = 0.0

    def forget(self, name: str) -> None:
        """`name` left the fleet: a backend added under its name starts afresh."""
        self._health.pop(name, None)

    def _start_due(self, now: float) -> None:
        for backend in self._registry.all():
            if backend.name in self._scraping or self._state(backend.name).next_probe_at > now:
                continue
            self._scraping.add(backend.name)
            self.scraper.get((backend.name, backend.url),
                             functools.partial(self._answered, backend))

    async def _answers(self, timeout_s: float) -> None:
        """Until every scrape started has answered, or `timeout_s`."""
        if self._scraping:
            self._all_answered.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._all_answered.wait()

    def _answered(self, backend: Backend, body: bytes | None) -> None:
        self._scraping.discard(backend.name)
        self.scrapes += 1
        text = None if body is None else body.decode("utf-8", "replace")
        self._arrived[backend.name] = self._next_stats(backend, text, time.monotonic())
        if self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_later(_COALESCE_S, self._flush)
        if not self._scraping:
            self._all_answered.set()

    def _flush(self) -> None:
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        if self._arrived:
            self._registry.update(self._arrived)
            self._arrived.clear()

    def _state(self, name: str) -> _Health:
        state = self._health.get(name)
        if state is None:
            state = self._health[name] = _Health()
        return state

    def _next_stats(self, backend: Backend, text: str | None, now: float) -> BackendStats:
        state = self._state(backend.name)
        last = self._arrived.get(backend.name) or self._registry.stats.get(
            backend.name, UNKNOWN_STATS)
        if text is not None:
            stats, state.cumulative = to_stats(parse_samples(text), state.cumulative, last, now)
            if now < state.ejected_until:  # (a scrape that was under way at the ejection)
                state.next_probe_at = state.ejected_until
                return replace(stats, healthy=False)
            if not last.healthy:
                log.info("backend %s is healthy", backend.name)
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
