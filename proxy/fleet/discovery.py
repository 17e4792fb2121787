"""What each backend serves besides its configured model: its `/v1/models`.

A vLLM server lists its served model name(s) and its LoRA adapters there (`--lora-modules
name=path`, or loaded at run time with `POST /v1/load_lora_adapter`; each adapter's
`parent` is the base model), and the context length (`max_model_len`: the bound a
continuation of a request without `max_tokens` asks for, proxy/migration/eligibility.py). Every
`poller.models_interval_s` the proxy reads the list of
each healthy backend (at most `_CONCURRENT` at once, each under `poller.timeout_s`) and
tells the registry, so a request for an adapter goes to the backends that have it loaded
and names the adapter there (Registry.model_on). A backend that does not answer, answers
with an error (a server that wants an API key) or with something else than a model list
keeps what it was last known to serve; an adapter unloaded from every backend is a 404
`model_not_found` from the next read on. A backend whose list omits its configured
model (a server restarted with another one, or a wrong `--served-model-name`) gets no
requests for that model until it lists it (vLLM would answer each with a 404), unless
`poller.require_listed_model` is off.

When this replica changes what backends serve (`/admin/lora_adapters`), it `announce`s
them; through the shared state (the `discovery` table) every other replica reads those
backends' lists at once instead of at its next periodic read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import orjson

from proxy.fleet.registry import Registry
from proxy.relay.upstream import Upstream, UpstreamFailure
from proxy.types import Backend

log = logging.getLogger("laneway.poller")

_CONCURRENT = 32  # reads in flight at once (the relay's connection pool is shared)
MAX_NAMES = 1000  # names kept per backend


class ModelDiscovery:
    def __init__(self, registry: Registry, upstream: Upstream, interval_s: float,
                 timeout_s: float, require_listed: bool = True) -> None:
        """`require_listed`: a backend whose list omits its configured model gets no
        requests for it (`poller.require_listed_model`)."""
        self._registry, self._upstream = registry, upstream
        self.require_listed = require_listed
        self.interval_s, self._timeout_s = interval_s, timeout_s
        self._slots = asyncio.Semaphore(_CONCURRENT)
        self._announced: list[str] = []  # backends whose lists this replica changed
        self._reads: set[asyncio.Task[int]] = set()  # asked for by other replicas

    async def run(self) -> None:
        """Read every `interval_s` forever (cancel to stop)."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.once()

    async def once(self, backends: Iterable[Backend] | None = None) -> int:
        """Read every healthy backend's list once (of `backends`, default all); the
        number of backends whose served models changed."""
        up = [b for b in (self._registry.all() if backends is None else backends)
              if self._registry.is_healthy(b.name)]
        lists = await asyncio.gather(*(self._served(b) for b in up))
        changed = 0
        for backend, listed in zip(up, lists, strict=True):
            if listed is not None:
                own = not self.require_listed or any(
                    m.get("id") == backend.model for m in listed)
                changed += self._registry.set_served(backend.name, model_ids(listed), own)
                self._registry.set_context(backend.name, context_length(listed))
        return changed

    def announce(self, names: Iterable[str]) -> None:
        """Tell the other replicas to read these backends' lists now."""
        self._announced.extend(names)

    def export_updates(self) -> list[Any]:
        """Replicated: the backends announced since the last call, as one write."""
        announced, self._announced = self._announced, []
        return [sorted(set(announced))] if announced else []

    def merge_updates(self, updates: list[Any]) -> None:
        """Replicated: another replica changed these backends' lists: read them."""
        names = {name for write in updates if isinstance(write, list)
                 for name in write if isinstance(name, str)}
        backends = [b for b in self._registry.all() if b.name in names]
        if backends:
            log.info("another replica changed what %s serve: reading their lists",
                     ", ".join(b.name for b in backends))
            task = asyncio.create_task(self.once(backends))
            self._reads.add(task)
            task.add_done_callback(self._reads.discard)

    async def _served(self, backend: Backend) -> list[dict[str, Any]] | None:
        async with self._slots:
            try:
                status, body, _ = await self._upstream.whole(
                    "GET", backend, "/v1/models", None, {}, timeout_s=self._timeout_s)
            except UpstreamFailure as failure:
                log.debug("backend %s: /v1/models: %s", backend.name, failure.detail)
                return None
        if status != 200:
            log.debug("backend %s: /v1/models answered %d", backend.name, status)
            return None
        return model_list(body)


def model_list(body: bytes) -> list[dict[str, Any]] | None:
    """The entries of an OpenAI model list (`{"data": [{"id": …}, …]}`), None if it is
    not one."""
    try:
        listed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    data = listed.get("data") if isinstance(listed, dict) else None
    if not isinstance(data, list):
        return None
    return [m for m in data if isinstance(m, dict)]


def model_ids(listed: list[dict[str, Any]]) -> list[str]:
    ids = [m["id"] for m in listed if isinstance(m.get("id"), str)]
    return ids[:MAX_NAMES]


def context_length(listed: list[dict[str, Any]]) -> int | None:
    """vLLM's `max_model_len` (one per server: its adapters share it), if listed."""
    lengths = [m.get("max_model_len") for m in listed]
    return next((n for n in lengths if isinstance(n, int) and not isinstance(n, bool)
                 and n > 0), None)
