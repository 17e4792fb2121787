"""The fleet's KV cache events: one exact index, and the subscribers that feed it.

A backend with `kv_events` in its config gets one subscriber per data-parallel rank
(proxy/fleet/kv_events.py) from the moment it is added (at start, by the admin API or
a reload) until it is removed; removing it also drops its blocks from the index, since
nothing would tell us any more what it evicts.

`add` and `remove` are synchronous (the admin and reload paths that call them are);
the sockets are opened and closed by tasks run one after the other, so a backend
replaced with the same bound endpoint closes the old socket before binding the new.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any

from proxy.config import KvEventsConfig
from proxy.fleet.kv_events import KvEventSource, KvEventSubscriber, rank_sources
from proxy.fleet.kv_index import KvIndex

log = logging.getLogger("laneway.kv_events")
COUNTERS = ("events", "gaps", "resyncs")  # exported per backend (metrics.py)


class KvFleet:
    def __init__(self, index: KvIndex | None = None) -> None:
        self.index = index or KvIndex()
        self._configs: dict[str, KvEventsConfig] = {}
        self._subscribers: dict[str, list[KvEventSubscriber]] = {}
        self._lock = asyncio.Lock()
        self._pending: set[asyncio.Task[None]] = set()

    def config_of(self, backend: str) -> KvEventsConfig | None:
        """`backend`'s KV events config (how it hashes its blocks); None: it has none."""
        return self._configs.get(backend)

    def add(self, backend: str, cfg: KvEventsConfig | None) -> None:
        """Start following `backend`'s events (nothing for `cfg` None); replaces what
        was followed under that name."""
        self.remove(backend)
        if cfg is None:
            return
        self._configs[backend] = cfg
        source = KvEventSource(backend, cfg.endpoint, cfg.replay_endpoint, cfg.topic,
                               bind=cfg.bind)
        subscribers = [KvEventSubscriber(s, self.index)
                       for s in rank_sources(source, cfg.data_parallel_size)]
        self._subscribers[backend] = subscribers
        self._run(self._start(backend, subscribers))

    def remove(self, backend: str) -> None:
        """Stop following `backend` and forget its blocks."""
        self._configs.pop(backend, None)
        subscribers = self._subscribers.pop(backend, None)
        self.index.drop(backend)
        if subscribers:
            self._run(self._stop(backend, subscribers))

    async def settled(self) -> None:
        """Wait until every start and stop asked for so far has run."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def close(self) -> None:
        for backend in list(self._subscribers):
            self.remove(backend)
        await self.settled()

    def counters(self) -> Iterator[tuple[str, str, int]]:
        """(backend, counter, value) summed over ranks, for every counter in `COUNTERS`."""
        for backend, subscribers in list(self._subscribers.items()):
            for name in COUNTERS:
                yield backend, name, sum(getattr(s, name) for s in subscribers)

    def sizes(self) -> Iterator[tuple[str, int]]:
        for backend in list(self._subscribers):
            yield backend, self.index.size(backend)

    def _run(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _start(self, backend: str, subscribers: Sequence[KvEventSubscriber]) -> None:
        async with self._lock:
            if self._subscribers.get(backend) is not subscribers:
                return  # removed (or replaced) before it started
            for subscriber in subscribers:
                endpoint = subscriber.source.endpoint
                try:
                    await subscriber.start()
                except Exception as exc:  # a bad or taken address: route without events
                    log.error("backend %s: KV events from %s not followed: %s", backend,
                              endpoint, exc)
                else:
                    log.info("backend %s: following KV events %s %s", backend,
                             "bound at" if subscriber.source.bind else "from", endpoint)

    async def _stop(self, backend: str, subscribers: Sequence[KvEventSubscriber]) -> None:
        async with self._lock:
            for subscriber in subscribers:
                await subscriber.stop()
            # what arrived between remove() and the stop; a replacement under the same
            # name starts after this (the lock), so nothing of its own is lost
            self.index.drop(backend)
