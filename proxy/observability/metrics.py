"""The proxy's Prometheus metrics, on a registry of its own (no module globals).

Per-request observations go through cached label children so the hot path pays a
dict lookup, not prometheus_client's label resolution. Gauges of backend state are
read at scrape time by a collector instead of being updated per request.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from proxy.types import Backend, BackendStats, Hedge, Outcome, SloTarget

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1)
_STALL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5)
# predicted / true completion tokens: ±10 %, ±25 % (the length predictor's reported
# accuracy), twice and four times either way
_RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2, 4)
_TOKEN_ERROR_BUCKETS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_PHASES = (("prefill", "cost_prefill"), ("decode", "cost_decode"))
_DECISION_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 1e-2)


class Fleet(Protocol):
    """What the backend gauges read at scrape time (proxy/fleet/registry.py's `Registry`)."""

    @property
    def local_inflight(self) -> Mapping[str, int]: ...
    @property
    def inflight(self) -> Mapping[str, int]: ...
    @property
    def stats(self) -> Mapping[str, BackendStats]: ...
    def all(self) -> tuple[Backend, ...]: ...


class KvCounts(Protocol):
    """What the KV-event metrics read at scrape time (proxy/fleet/kv_fleet.py's `KvFleet`)."""

    def counters(self) -> Iterator[tuple[str, str, int]]: ...
    def sizes(self) -> Iterator[tuple[str, int]]: ...


class Metrics:
    def __init__(self, registry: Fleet, kv: KvCounts | None = None) -> None:
        # `_created` series double the output and nobody reads them.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "laneway_requests", "Requests finished, by outcome",
            ["model", "backend", "policy", "status"], registry=r)
        self.ttft = Histogram(
            "laneway_ttft_seconds", "Time to first token seen by the proxy",
            ["model", "backend", "policy"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(
            "laneway_tpot_seconds", "Mean time per output token of a stream",
            ["model", "backend", "policy"], buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(
            "laneway_e2e_seconds", "End-to-end request latency",
            ["model", "backend", "policy"], buckets=_LATENCY_BUCKETS, registry=r)
        self.decision = Histogram(
            "laneway_routing_decision_seconds", "Time spent in a policy's pick",
            ["policy"], buckets=_DECISION_BUCKETS, registry=r)
        self.prediction = Histogram(
            "laneway_prediction_seconds", "Time spent predicting a request's cost",
            buckets=_DECISION_BUCKETS, registry=r)
        self.length_ratio = Histogram(
            "laneway_length_prediction_ratio", "Arrival-time output-length prediction / "
            "the completion tokens of requests that finished with one (length predictor)",
            ["model"], buckets=_RATIO_BUCKETS, registry=r)
        self.length_error = Histogram(
            "laneway_length_prediction_error_tokens", "|Arrival-time output-length "
            "prediction - completion tokens| of requests that finished with one",
            ["model"], buckets=_TOKEN_ERROR_BUCKETS, registry=r)
        self.retries = Counter(
            "laneway_retries", "Attempts moved to another backend before the first byte",
            ["model", "backend", "reason"], registry=r)
        self.upstream_errors = Counter(
            "laneway_upstream_errors", "Backend failures seen by the relay",
            ["backend", "kind"], registry=r)
        self.ejections = Counter(
            "laneway_backend_ejections", "Backends taken out by passive health (most of "
            "their recent attempts failed; README, Failure handling)", ["backend"], registry=r)
        self.error_responses = Counter(
            "laneway_error_responses", "Error responses the proxy made itself",
            ["status", "code"], registry=r)
        self.disconnects = Counter(
            "laneway_client_disconnects", "Clients that went away mid-request",
            ["model", "backend"], registry=r)
        self.migrations = Counter(
            "laneway_migrations", "Requests moved to another backend mid-generation",
            ["reason", "source", "target"], registry=r)
        self.migration_failures = Counter(
            "laneway_migration_failures", "Moves abandoned (the request stayed where it was)",
            ["reason", "target"], registry=r)
        self.handoff_stall = Histogram(
            "laneway_handoff_stall_seconds",
            "Client-visible gap between the last token before a move and the first after",
            buckets=_STALL_BUCKETS, registry=r)
        self.reprefilled = Counter(
            "laneway_migration_reprefilled_tokens",
            "Tokens (prompt + generated) a move made a target prefill again",
            ["target"], registry=r)
        self.slo = Counter(
            "laneway_slo_requests", "Requests that carried an SLO (x-laneway-slo-ms), by "
            "whether they finished within it (failures count as missed)",
            ["model", "policy", "met"], registry=r)
        self.slo_class_requests = Counter(
            "laneway_slo_class_requests", "Requests by SLO class (slo_classes) and whether "
            "the relayed answer met it (met, missed; a failed or abandoned one missed)",
            ["slo_class", "outcome"], registry=r)
        self.slo_class_ttft = Histogram(
            "laneway_slo_class_ttft_seconds", "Time to first token of answered requests, "
            "by SLO class", ["slo_class"], buckets=_LATENCY_BUCKETS, registry=r)
        self.slo_class_tpot = Histogram(
            "laneway_slo_class_tpot_seconds", "Mean time per output token of answered "
            "streams, by SLO class", ["slo_class"], buckets=_TPOT_BUCKETS, registry=r)
        self.passthrough = Counter(
            "laneway_passthrough_requests", "Requests on the endpoints that generate "
            "nothing (embeddings, score, rerank, pooling, tokenize, ...), by outcome",
            ["endpoint", "model", "backend", "status"], registry=r)
        self.passthrough_seconds = Histogram(
            "laneway_passthrough_seconds", "Latency of answered pass-through requests",
            ["endpoint", "model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.fallbacks = Counter(
            "laneway_fallbacks", "Requests sent to a fallback model (model_fallbacks) "
            "because no backend of the requested one answered", ["model", "fallback"],
            registry=r)
        self.flow_queued = Gauge(
            "laneway_flow_queued_requests", "Requests waiting in the proxy for a backend "
            "with room (flow_control)", registry=r)
        self.flow_wait = Histogram(
            "laneway_flow_wait_seconds", "Time requests waited for a backend with room "
            "(flow_control), by priority", ["model", "priority"], buckets=_LATENCY_BUCKETS,
            registry=r)
        self.flow_leased = Gauge(
            "laneway_flow_leased_slots", "Slots this replica leased on each backend "
            "(flow_control.strict with shared state)", ["backend"], registry=r)
        self.flow_rejected = Counter(
            "laneway_flow_rejected", "Requests flow control answered 503 overloaded",
            ["model", "reason"], registry=r)
        self.retry_waits = Counter(
            "laneway_retry_waits", "Waits of requests none of whose backends answered, "
            "before trying them again (upstream.retry_window_s)", ["model"], registry=r)
        self.response_homes = Counter(
            "laneway_response_home_lookups", "Stored-response ids looked up (a "
            "previous_response_id, GET or cancel), by how the backend holding it was "
            "found: remembered (relayed here or told by another replica), asked (the "
            "backends were asked), missing (none has it)", ["found"], registry=r)
        self.trace_spans_dropped = Counter(
            "laneway_trace_spans_dropped", "Spans not exported (tracing): the collector "
            "failed or the queue was full (tracing.max_queued_spans)", registry=r)
        self.state_connected = Gauge(
            "laneway_state_connected", "1 if the last exchange with the shared state "
            "store succeeded", registry=r)
        self.state_failures = Counter(
            "laneway_state_sync_failures", "Failed exchanges with the shared state store "
            "(the proxy keeps serving on local state)", registry=r)
        self.state_replicas = Gauge(
            "laneway_state_replicas", "Live proxy replicas seen in the shared state", registry=r)
        self.state_flow_modes = Gauge(
            "laneway_state_flow_modes", "Different flow-control modes (strict or not, and "
            "the limit) among the live replicas, as this one last saw them: above 1, the "
            "replicas do not hold one limit together", registry=r)
        self.state_sync = Histogram(
            "laneway_state_sync_seconds", "Duration of one exchange with the shared state",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.side_decisions = Counter(
            "laneway_side_decisions", "Decisions on backends with a `side` label "
            "(DiSCo), by the side of the first leg and of the hedge (`none`: not raced)",
            ["policy", "first", "hedge"], registry=r)
        self.hedge_delay = Histogram(
            "laneway_hedge_delay_seconds", "The delay a policy set before a hedge leg, "
            "by the hedge's side", ["side"], buckets=_LATENCY_BUCKETS, registry=r)
        self.race_wins = Counter(
            "laneway_race_wins", "Raced requests by the winner's side and leg (first or "
            "hedge) and whether the hedge was opened (not: the first leg's token came "
            "before its delay)", ["side", "leg", "hedge_opened"], registry=r)
        self.side_prompt_tokens = Counter(
            "laneway_side_prompt_tokens", "Prompt tokens per side (backends with a "
            "`side` label): every started leg counts its whole prompt, also a race's "
            "aborted one (the realized budget)", ["side"],
            registry=r)
        self.cost_units = Counter(
            "laneway_cost_units", "Tokens on side-labelled backends times the price "
            "labels (cost_prefill, cost_decode; their unit: $ per 1M tokens for a server, J "
            "per token for a device), per backend and phase", ["backend", "phase"],
            registry=r)
        r.register(_BackendCollector(registry))
        if kv is not None:
            r.register(_KvEventsCollector(kv))
        self._children: dict[tuple[str, str, str], tuple[Any, Any, Any]] = {}

    def observe(self, outcome: Outcome) -> None:
        key = (outcome.model, outcome.backend, outcome.policy)
        children = self._children.get(key)
        if children is None:
            children = (self.ttft.labels(*key), self.tpot.labels(*key), self.e2e.labels(*key))
            self._children[key] = children
        ttft, tpot, e2e = children
        self.requests.labels(*key, str(outcome.status)).inc()
        if outcome.ok:
            if outcome.ttft_s is not None:
                ttft.observe(outcome.ttft_s)
            if outcome.tpot_s is not None:
                tpot.observe(outcome.tpot_s)
            e2e.observe(outcome.e2e_s)

    def observe_slo_class(self, target: SloTarget, outcome: Outcome | None) -> None:
        """A request of SLO class `target` ended (`outcome` None: no backend answered).
        The label is a configured class's name, never the client's text."""
        met = outcome is not None and slo_met(target, outcome)
        self.slo_class_requests.labels(target.name, "met" if met else "missed").inc()
        if outcome is not None and outcome.ok:
            if outcome.ttft_s is not None:
                self.slo_class_ttft.labels(target.name).observe(outcome.ttft_s)
            if outcome.tpot_s is not None:
                self.slo_class_tpot.labels(target.name).observe(outcome.tpot_s)

    def observe_passthrough(self, endpoint: str, model: str, outcome: Outcome) -> None:
        self.passthrough.labels(endpoint, model, outcome.backend, str(outcome.status)).inc()
        if outcome.ok:
            self.passthrough_seconds.labels(endpoint, model).observe(outcome.e2e_s)

    def observe_length(self, model: str, predicted: float, outcome: Outcome) -> None:
        """How far the length predictor's arrival estimate was from the answer, for a
        request that finished well (a failed or abandoned one has no true length)."""
        if not outcome.ok or outcome.completion_tokens <= 0:
            return
        actual = outcome.completion_tokens
        self.length_ratio.labels(model).observe(predicted / actual)
        self.length_error.labels(model).observe(abs(predicted - actual))

    def decided(self, policy: str, first: Backend, hedge: Hedge | None) -> None:
        """A decision on side-labelled backends: which side leads, which one hedges
        (DiSCo-D: server then device; DiSCo-S: device then server), after how long."""
        if hedge is None:
            self.side_decisions.labels(policy, side_of(first), "none").inc()
            return
        self.side_decisions.labels(policy, side_of(first), side_of(hedge.backend)).inc()
        self.hedge_delay.labels(side_of(hedge.backend)).observe(hedge.delay_s)

    def race_won(self, winner: Any, hedge_opened: bool) -> None:
        """`winner`: the RaceLeg that kept the request (proxy/relay/race.py)."""
        self.race_wins.labels(side_of(winner.backend), "hedge" if winner.hedge else "first",
                              "yes" if hedge_opened else "no").inc()

    def observe_leg(self, backend: Backend, prompt_tokens: int | None,
                    completion_tokens: int) -> None:
        """One started leg of a race: its prompt counts whole (as the budget counts it),
        and what it cost at the backend's price labels."""
        if prompt_tokens:
            self.side_prompt_tokens.labels(side_of(backend)).inc(prompt_tokens)
        for (phase, label), tokens in zip(_PHASES, (prompt_tokens or 0, completion_tokens),
                                          strict=True):
            price = _price(backend, label)
            if price is not None and tokens:
                self.cost_units.labels(backend.name, phase).inc(tokens * price)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def slo_met(target: SloTarget, outcome: Outcome) -> bool:
    """Whether an answer met its class, as SLICE's evaluation judges (Sec. VI-A): a
    real-time class by its completion within the deadline, any other by its TTFT and
    its mean TPOT. An answer without a TPOT (not streamed, or one token) must arrive
    whole within TTFT + TPOT for each further token."""
    if not outcome.ok:
        return False
    if target.deadline_ms is not None:
        return outcome.e2e_s * 1000 <= target.deadline_ms
    ttft_ms = target.ttft_ms if target.ttft_ms is not None else float("inf")
    if outcome.tpot_s is None:  # (its "TTFT" is the whole answer's time)
        later_tokens = max(0, outcome.completion_tokens - 1)
        return outcome.e2e_s * 1000 <= ttft_ms + target.tpot_ms * later_tokens
    return (outcome.ttft_s is not None and outcome.ttft_s * 1000 <= ttft_ms
            and outcome.tpot_s * 1000 <= target.tpot_ms)


class _BackendCollector(Collector):
    """Backend gauges read from the registry at scrape time."""

    _HELP = {
        "inflight": ("laneway_backend_inflight", "Requests open on the backend via this proxy"),
        "cluster": ("laneway_backend_cluster_inflight", "Requests open on the backend via "
                    "every replica (shared state)"),
        "healthy": ("laneway_backend_healthy", "1 if the backend is routable"),
        "running": ("laneway_backend_running", "vllm:num_requests_running at the last scrape"),
        "waiting": ("laneway_backend_waiting", "vllm:num_requests_waiting at the last scrape"),
        "kv": ("laneway_backend_kv_usage", "KV-cache usage fraction at the last scrape"),
    }

    def __init__(self, registry: Fleet) -> None:
        self._registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {key: GaugeMetricFamily(name, text, labels=["backend", "model"])
                    for key, (name, text) in self._HELP.items()}
        for backend in self._registry.all():
            labels = [backend.name, backend.model]
            stats = self._registry.stats.get(backend.name)
            families["inflight"].add_metric(labels,
                                             self._registry.local_inflight.get(backend.name, 0))
            families["cluster"].add_metric(labels, self._registry.inflight.get(backend.name, 0))
            families["healthy"].add_metric(labels, 1.0 if stats and stats.healthy else 0.0)
            if stats is not None:
                families["running"].add_metric(labels, stats.running)
                families["waiting"].add_metric(labels, stats.waiting)
                families["kv"].add_metric(labels, stats.kv_usage)
        yield from families.values()


def side_of(backend: Backend) -> str:
    """A backend's side for DiSCo (its `side` label; unlabelled: server), as a label
    value from a fixed set."""
    return "device" if backend.labels.get("side") == "device" else "server"


def _price(backend: Backend, label: str) -> float | None:
    try:
        price = float(backend.labels[label])
    except (KeyError, ValueError):
        return None
    return price if 0.0 <= price < float("inf") else None


class _KvEventsCollector(Collector):
    """The KV-event subscribers' counters and the exact index's size, per configured
    backend (policy kv_aware; docs/kv_events.md), read at scrape time."""

    _HELP = {
        "events": ("laneway_kv_events", "KV cache events applied to the index"),
        "gaps": ("laneway_kv_event_gaps", "Event batches missed (a replay was asked)"),
        "resyncs": ("laneway_kv_event_resyncs", "Times the backend's blocks were dropped "
                    "and rebuilt from the replay buffer (a gap the replay could not fill, "
                    "a restart)"),
    }

    def __init__(self, kv: KvCounts) -> None:
        self._kv = kv

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        counters = {key: CounterMetricFamily(name, text, labels=["backend"])
                    for key, (name, text) in self._HELP.items()}
        for backend, key, value in self._kv.counters():
            counters[key].add_metric([backend], value)
        blocks = GaugeMetricFamily("laneway_kv_index_blocks", "KV blocks the exact index "
                                   "holds for the backend (per rank and hash)",
                                   labels=["backend"])
        for backend, size in self._kv.sizes():
            blocks.add_metric([backend], size)
        yield from counters.values()
        yield blocks
