"""Every long-lived resource of one proxy process, created and closed together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from types import MappingProxyType

import aiohttp

from policies.base import build_policy
from predictors.base import Prediction, load_length_predictor
from proxy.config import Settings
from proxy.metrics import Metrics
from proxy.migration import ActiveStreams
from proxy.poller import Poller
from proxy.registry import Registry
from proxy.relay import Upstream, UpstreamFailure
from proxy.routing import Router
from proxy.types import Backend, RequestContext

log = logging.getLogger("laneway")


def backends_from(settings: Settings) -> list[Backend]:
    return [
        Backend(
            name=b.name,
            url=str(b.url).rstrip("/"),
            model=b.model,
            labels=MappingProxyType(dict(b.labels)),
        )
        for b in settings.backends
    ]


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.registry = Registry(backends_from(settings))
        self.metrics = Metrics(self.registry)
        policy = build_policy(settings.policy.name, settings.policy.params)
        self.router = Router(policy, self.metrics, log_decisions=settings.debug.log_decisions)
        length = settings.predictors.length
        self.predictor = load_length_predictor(length.artifact, length.model_map,
                                               length.fallback_key)
        self._relay_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=settings.upstream.pool_size, ttl_dns_cache=300,
                keepalive_timeout=settings.upstream.keepalive_s),
            auto_decompress=False,  # relay bytes exactly as the backend sent them
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        self._poll_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        )
        self.upstream = Upstream(self._relay_session, settings.upstream)
        self.streams = ActiveStreams()
        self.poller = Poller(self.registry, settings.poller, self._poll_session)
        self._poll_task: asyncio.Task[None] | None = None
        self.started_at_wall = time.time()

    async def start(self) -> None:
        """Poll once so that health is known before the first request, then keep polling."""
        await self.poller.poll_once()
        healthy = [b.name for b in self.registry.all() if self.registry.is_healthy(b.name)]
        log.info("policy %s; %d/%d backends healthy: %s", self.router.policy_name,
                 len(healthy), len(self.registry.all()), ", ".join(healthy) or "none")
        self._poll_task = asyncio.create_task(self.poller.run(), name="laneway-poller")

    async def close(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll_task
        await self._relay_session.close()
        await self._poll_session.close()

    def predict(self, ctx: RequestContext) -> Prediction:
        """The request's predicted cost, for `router.pick` (synchronous, ≤ 1 ms)."""
        return self.predictor.predict(ctx)

    def predict_window(self, ctx: RequestContext, generated_text: str,
                       generated_tokens: int) -> Prediction:
        """Re-estimate mid-stream (every τ tokens), for `router.reroute`."""
        return self.predictor.predict_window(ctx, generated_text, generated_tokens)

    def upstream_failed(self, failure: UpstreamFailure, model: str) -> None:
        log.warning("attempt on %s failed (%s): %s", failure.backend.name, failure.kind,
                    failure.detail)
        self.metrics.upstream_errors.labels(failure.backend.name, failure.kind).inc()
        self.metrics.retries.labels(model, failure.backend.name, failure.kind).inc()
        if failure.unreachable:
            self.poller.report_failure(failure.backend.name, failure.kind)
