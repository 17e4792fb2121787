"""Run the configured policy: its stages (proxy/routing/stages.py), then the pick; time every
decision and explain it in the log."""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable
from typing import Any

from policies.base import Policy, Rerouting
from proxy.observability.metrics import Metrics
from proxy.observability.tracing import current_span
from proxy.routing.kv_prefix_stage import KvEvents
from proxy.routing.stage_builder import stages_for
from proxy.routing.stages import ModelOn, Stage, base_model
from proxy.types import ClusterView, Decision, Outcome, Prediction, Progress, RequestContext

log = logging.getLogger("laneway.routing")


class Router:
    def __init__(self, policy: Policy, metrics: Metrics, *, log_decisions: bool,
                 model_on: ModelOn = base_model, tls: ssl.SSLContext | None = None,
                 kv: KvEvents | None = None) -> None:
        """`model_on`: Registry.model_on, and `tls`: the https backends' CA (None: the
        system's), for stages that send the request themselves; `kv`: the fleet's KV
        events (Runtime.kv), for a stage that reads them."""
        self.policy = policy
        self.policy_name = policy.name
        self._timer = metrics.decision.labels(policy.name)
        self._log_level = logging.INFO if log_decisions else logging.DEBUG
        reroute = getattr(policy, "reroute", None)
        self._rerouting: Rerouting | None = policy if callable(reroute) else None  # type: ignore[assignment]
        self.stages: list[Stage] = stages_for(policy, model_on, tls, kv)

    @property
    def reroutes(self) -> bool:
        """Whether the policy checks running streams (then they are tracked)."""
        return self._rerouting is not None

    async def prepare(self, ctx: RequestContext, data: dict[str, Any], pred: Prediction,
                      view: Callable[[], ClusterView]) -> Prediction:
        """`pred` completed by the policy's stages, in order (none for most policies)."""
        for stage in self.stages:
            pred = await stage.predict(ctx, data, pred, view())
        return pred

    async def close(self) -> None:
        for stage in self.stages:
            await stage.close()

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        started = time.perf_counter()
        decision = self.policy.pick(ctx, pred, view)
        took = time.perf_counter() - started
        self._timer.observe(took)
        if (span := current_span()) is not None:  # traced: why this backend
            span.add_event("routed", {
                "laneway.backend": decision.backend.name, "laneway.policy": self.policy_name,
                "laneway.reason": decision.drop or decision.reason,
                "laneway.candidates": len(view.candidates), "laneway.decision_us": took * 1e6})
        if log.isEnabledFor(self._log_level):
            # (the client's own x-request-id beside the proxy's unique one, to find it by)
            sent = f" (x-request-id {ctx.client_id})" if ctx.client_id else ""
            log.log(self._log_level, "request %s%s model=%s -> %s (%s; %d candidates)",
                    ctx.request_id, sent, ctx.model, decision.backend.name, decision.reason,
                    len(view.candidates))
        return decision

    def reroute(
        self, ctx: RequestContext, pred: Prediction, progress: Progress, view: ClusterView
    ) -> Decision | None:
        if self._rerouting is None or not view.candidates:
            return None
        started = time.perf_counter()
        decision = self._rerouting.reroute(ctx, pred, progress, view)
        self._timer.observe(time.perf_counter() - started)
        if decision is not None:
            log.info("request %s: policy moves it %s -> %s after %d tokens (%s)",
                     ctx.request_id, progress.backend.name, decision.backend.name,
                     progress.generated, decision.reason)
        return decision

    def observe(self, outcome: Outcome) -> None:
        self.policy.observe(outcome)
