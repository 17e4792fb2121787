"""Every long-lived resource of one proxy process, created and closed together."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

import aiohttp
from pydantic import SecretStr

from policies.base import Policy, build_policy
from policies.load_helpers import LeastInflight
from predictors.length import load_length_predictor
from proxy.admission.auth import Auth, Grant, anthropic_limit_headers
from proxy.admission.flow_control import ANYONE, FlowControl, Place
from proxy.asgi import Scope, Send, send_error, with_headers
from proxy.config import BackendConfig, Settings
from proxy.errors import InvalidRequest, ModelNotFound, ProxyError
from proxy.fleet.active_streams import ActiveStreams
from proxy.fleet.discovery import ModelDiscovery
from proxy.fleet.kv_fleet import KvFleet
from proxy.fleet.outliers import Outliers
from proxy.fleet.poller import Poller
from proxy.fleet.registry import Registry
from proxy.observability.access_log import note
from proxy.observability.metrics import Metrics
from proxy.observability.tracing import Tracing
from proxy.relay.upstream import Upstream, UpstreamFailure
from proxy.routing.recompute import recompute_tables
from proxy.routing.router import Router
from proxy.state import build_store, new_replica_id
from proxy.state.rate_counters import WindowCounters
from proxy.state.replicator import Replicator
from proxy.state.response_homes import ResponseHomes
from proxy.tasks import stop_task
from proxy.tls import upstream_context
from proxy.types import Backend, Outcome, Prediction, RequestContext

log = logging.getLogger("laneway")
# upstream.retry_window_s: the first wait, doubled each round up to the last.
_RETRY_PAUSE_S, _RETRY_PAUSE_MAX_S = 0.1, 1.0
PRIORITY_HEADER, MAX_HEADER_PRIORITY = "x-laneway-priority", 10


def backends_from(settings: Settings) -> list[Backend]:
    """The backends the config names; each without its own key gets upstream.api_key."""
    return [backend_of(b, settings.upstream.api_key) for b in settings.backends]


def backend_of(cfg: BackendConfig, default_key: SecretStr | None = None) -> Backend:
    """`cfg` as routed to; `default_key` if it has no key of its own (the operator's
    upstream key only for backends the config file names: one added through the
    admin API must not receive it)."""
    return Backend(
        name=cfg.name,
        url=str(cfg.url).rstrip("/"),
        model=cfg.model,
        labels=MappingProxyType(dict(cfg.labels)),
        api_key=_secret(cfg.api_key or default_key),
    )


def _secret(value: SecretStr | None) -> str | None:
    """The key, None for none or an empty one (`VAR=` in a compose file)."""
    return None if value is None else value.get_secret_value() or None


class Runtime:
    def __init__(self, settings: Settings, config_path: str | None = None,
                 policy: Policy | None = None) -> None:
        """`policy`: built from `settings.policy` already (by the config check); built
        here when None."""
        self.settings = settings
        self.config_path = config_path  # re-read by SIGHUP and POST /admin/reload
        self.registry = Registry(backends_from(settings), settings.model_groups,
                                 panic=settings.poller.route_when_all_unhealthy)
        self.kv = KvFleet()  # KV events of the backends with `kv_events` (from start())
        self.metrics = Metrics(self.registry, self.kv)
        if policy is None:
            policy = build_policy(settings.policy.name, settings.policy.params)
        # https backends' CA (None: the system's)
        self.tls = upstream_context(settings.upstream.tls_ca_file)
        self.router = Router(policy, self.metrics, log_decisions=settings.debug.log_decisions,
                             model_on=self.registry.model_on, tls=self.tls, kv=self.kv)
        self._retired: set[asyncio.Task[None]] = set()  # routers of earlier policies
        self.least_inflight = LeastInflight()  # picks for proxy/http/passthrough_routes.py
        self.responses = ResponseHomes(settings.responses.remember)  # stored responses' homes
        length = settings.predictors.length
        self.predictor = load_length_predictor(length.artifact, length.model_map,
                                               length.fallback_key)
        self._relay_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                ssl=self.tls or True, limit=settings.upstream.pool_size, ttl_dns_cache=300,
                keepalive_timeout=settings.upstream.keepalive_s),
            auto_decompress=False,  # relay bytes exactly as the backend sent them
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        self.streams = ActiveStreams()
        self.poller = Poller(self.registry, settings.poller, self.tls)
        self.outliers = Outliers(lambda: self.settings.outliers, self._eject, self._peers)
        self.tracing = None if settings.tracing.otlp_endpoint is None else Tracing(
            settings.tracing, self.metrics.trace_spans_dropped.inc)
        self.upstream = Upstream(self._relay_session, settings.upstream, self.outliers.sent,
                                 self.tracing)
        self.flow = FlowControl(lambda: self.settings, self.registry, self.metrics)
        self.discovery = ModelDiscovery(self.registry, self.upstream,
                                        settings.poller.models_interval_s,
                                        settings.poller.timeout_s,
                                        settings.poller.require_listed_model)
        self._discover_task: asyncio.Task[None] | None = None
        self._poll_task: asyncio.Task[None] | None = None
        self.started_at_wall = time.time()
        self.replica_id = new_replica_id()
        counters = WindowCounters()
        self.auth = Auth(settings.auth, counters)
        self.replicator = Replicator(
            build_store(settings.state, self.replica_id), settings.state, self.registry,
            counters, self.metrics, lambda: self.router.policy,
            on_keys=self.auth.set_store_keys if settings.auth.redis_keys else None,
            tables={"responses": self.responses, "discovery": self.discovery},
            leasing=self.flow)
        self._sync_task: asyncio.Task[None] | None = None
        self._recompute_task: asyncio.Task[None] | None = None  # policies' tables

    async def start(self) -> None:
        """Poll once so that health is known before the first request, then keep polling."""
        if self.tracing is not None:
            await self.tracing.start()
        for cfg in self.settings.backends:
            self.kv.add(cfg.name, cfg.kv_events)
        await self.poller.poll_once()
        healthy = [b.name for b in self.registry.all() if self.registry.is_healthy(b.name)]
        log.info("policy %s; %d/%d backends healthy: %s", self.router.policy_name,
                 len(healthy), len(self.registry.all()), ", ".join(healthy) or "none")
        self._poll_task = asyncio.create_task(self.poller.run(), name="laneway-poller")
        if self.discovery.interval_s > 0:  # adapters routable from the first request
            await self.discovery.once()
            self._discover_task = asyncio.create_task(self.discovery.run(),
                                                      name="laneway-discovery")
        await self.replicator.sync_once()  # shared state before the first request
        self._sync_task = asyncio.create_task(self.replicator.run(), name="laneway-state")
        self._recompute_task = asyncio.create_task(
            recompute_tables(lambda: self.router.policy), name="laneway-recompute")

    async def close(self) -> None:
        for task in (self._poll_task, self._sync_task, self._discover_task,
                     self._recompute_task):
            await stop_task(task)
        await self.kv.close()
        await self.replicator.store.close()
        await self._relay_session.close()
        await self.poller.scraper.close()
        for task in self._retired:
            task.cancel()  # each closes its router's stages as it ends
        await asyncio.gather(*self._retired, return_exceptions=True)
        await self.router.close()
        if self.tracing is not None:
            await self.tracing.close()

    def replace_router(self, router: Router, grace_s: float = 60.0) -> None:
        """Route with `router` from now on; the old one's stages close after `grace_s`
        (requests it already prepared may still be using them)."""
        old, self.router = self.router, router

        async def retire() -> None:
            try:
                await asyncio.sleep(grace_s)
            finally:
                await old.close()

        task = asyncio.get_running_loop().create_task(retire())
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)

    def default_model(self) -> str | None:
        """The model of a request that names none: `server.default_model`, else the
        fleet's when it serves exactly one (as vLLM answers with its one model)."""
        configured = self.settings.server.default_model
        if configured is not None:
            return configured
        names = self.registry.model_names()
        return names[0] if len(names) == 1 else None

    def predict(self, ctx: RequestContext) -> Prediction:
        """The request's predicted cost, for `router.pick` (synchronous, ≤ 1 ms)."""
        return self.predictor.predict(ctx)

    def predict_window(self, ctx: RequestContext, generated_text: str,
                       generated_tokens: int) -> Prediction:
        """Re-estimate mid-stream (every τ tokens), for `router.reroute`."""
        return self.predictor.predict_window(ctx, generated_text, generated_tokens)

    def finished(self, ctx: RequestContext, grant: Grant | None,
                 outcome: Outcome | None, predicted_tokens: float | None = None) -> None:
        """A request ended (`outcome` None: no backend answered): settle its token
        charge, count its SLO (and its SLO class's) and how far its length prediction
        (`predicted_tokens`, at arrival) was from its answer."""
        self.auth.settle(grant, outcome)
        if predicted_tokens is not None and outcome is not None:
            self.metrics.observe_length(ctx.model, predicted_tokens, outcome)
        if ctx.slo_ms is not None:
            met = (outcome is not None and outcome.ok
                   and outcome.e2e_s * 1000 <= ctx.slo_ms)
            self.metrics.slo.labels(ctx.model, self.router.policy_name,
                                    "true" if met else "false").inc()
        if ctx.slo_class is not None:
            self.metrics.observe_slo_class(ctx.slo_class, outcome)

    def models_to_try(self, model: str) -> Iterator[str]:
        """`model`, then the models a request for it may fall back to (`model_fallbacks`),
        in order; each fallback only if it has a routable backend when its turn comes
        (checked lazily: most requests never get past `model`)."""
        yield model
        for fallback in self.settings.model_fallbacks.get(model, ()):
            if self.registry.view(fallback, time.monotonic()).candidates:
                yield fallback

    def retry_pause(self, model: str, arrived_at: float, rounds: int,
                    failures: list[UpstreamFailure]) -> float | None:
        """Seconds a request for `model` that arrived at `arrived_at` waits before trying
        its backends again, after `rounds` rounds in which none answered; None once
        `upstream.retry_window_s` is spent (the request then gets its 503/502/504)."""
        left = arrived_at + self.settings.upstream.retry_window_s - time.monotonic()
        if left <= 0:
            return None
        pause = min(left, _RETRY_PAUSE_S * 2.0 ** min(rounds, 10), _RETRY_PAUSE_MAX_S)
        why = "; ".join(f"{f.backend.name}: {f.kind}" for f in failures[-3:]) or "none routable"
        log.info("no backend of %s answered (%s); trying again in %.2f s (%.1f s of the retry "
                 "window left)", model, why, pause, left)
        self.metrics.retry_waits.labels(model).inc()
        return pause

    def falling_back(self, request_id: str, requested: str, previous: str, model: str,
                     failures: list[UpstreamFailure]) -> None:
        """Log and count a request for `requested` going to its fallback `model` after no
        backend of `previous` answered."""
        why = "; ".join(f"{f.backend.name}: {f.kind}" for f in failures) or "none healthy"
        log.warning("request %s: no backend of %s answered (%s); falling back to %s",
                    request_id, previous, why, model)
        self.metrics.fallbacks.labels(requested, model).inc()

    def admit(self, scope: Scope, send: Send, model: str,
              charge: Callable[[], Grant | None], anthropic: bool = False
              ) -> tuple[Grant | None, Send]:
        """Admit a request for `model`: `charge` checks the client's key and charges its
        limits (raising 401/403/429), then a backend must serve `model` (404 refunds the
        charge). Returns the grant and `send` adding its rate-limit headers (under the
        Anthropic API's names for a `/v1/messages` client); the access log notes both."""
        note(scope, model=model)
        grant = charge()
        note(scope, key=grant and grant.key.name)
        if grant is not None and grant.headers:
            send = with_headers(send, anthropic_limit_headers(grant.headers)
                                if anthropic else grant.headers)
        self.require_served(model, grant)
        return grant, send

    def queue_place(self, grant: Grant | None, headers: Mapping[str, str]) -> Place:
        """Where a request waits when flow control holds it: its priority (the key's;
        with `auth` off, its `x-laneway-priority` header if allowed) and its tenant
        (the key's name), whose requests share the tenant's turn in round-robin."""
        if grant is not None:
            return Place(grant.key.priority, grant.key.name)
        raw, cfg = headers.get(PRIORITY_HEADER), self.settings.flow_control
        if raw is None or not cfg.priority_header or cfg.max_inflight_per_backend == 0:
            return ANYONE  # (flow control off: the header means nothing, even a bad one)
        try:
            priority = int(raw)
        except ValueError:
            priority = None
        if priority is None or abs(priority) > MAX_HEADER_PRIORITY:
            # bounded: the priority is a metric label, and clients choose it
            raise InvalidRequest(f"{PRIORITY_HEADER} must be an integer from "
                                 f"-{MAX_HEADER_PRIORITY} to {MAX_HEADER_PRIORITY}, not "
                                 f"{raw[:40]!r}.")
        return Place(priority)

    def require_served(self, model: str, grant: Grant | None) -> None:
        """Raise `ModelNotFound` (refunding `grant`) unless a backend serves `model`."""
        if not self.registry.serves(model):
            self.auth.settle(grant, None)
            raise ModelNotFound(model)

    async def refuse(self, send: Send, err: ProxyError, anthropic: bool = False) -> None:
        """Answer with the proxy's own error `err` (in the Anthropic API's shape for a
        `/v1/messages` client), counted by status and code."""
        self.count_refused(err)
        await send_error(send, err, anthropic)

    def count_refused(self, err: ProxyError) -> None:
        """Count an error answer of the proxy's own (`laneway_error_responses_total`)."""
        self.metrics.error_responses.labels(str(err.status), err.code or err.type).inc()

    def count_upstream_error(self, backend: str, kind: str) -> None:
        """A backend failed a request (`kind`: connect, timeout, status, broken, error)."""
        self.metrics.upstream_errors.labels(backend, kind).inc()
        self.outliers.failed(backend, kind)

    def _peers(self, backend: str) -> list[str]:
        """The backends of `backend`'s model (itself among them)."""
        own = self.registry.get(backend)
        model = own.model if own is not None else None
        return [b.name for b in self.registry.all() if b.model == model] or [backend]

    def _eject(self, backend: str, for_s: float) -> None:
        self.metrics.ejections.labels(backend).inc()
        self.poller.eject(backend, for_s)

    def upstream_failed(self, failure: UpstreamFailure, model: str) -> None:
        log.warning("attempt on %s failed (%s): %s", failure.backend.name, failure.kind,
                    failure.detail)
        self.count_upstream_error(failure.backend.name, failure.kind)
        self.metrics.retries.labels(model, failure.backend.name, failure.kind).inc()
        if failure.unreachable:
            self.poller.report_failure(failure.backend.name, failure.kind)
