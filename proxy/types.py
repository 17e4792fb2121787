"""Immutable values that flow along the request path (see DESIGN.md).

Every arrow of the request path carries one of these. They are frozen so that a
policy can never reach back and change what the proxy or the poller observed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

Endpoint = Literal["chat", "completions", "responses", "messages"]


@dataclass(frozen=True, slots=True)
class Backend:
    """One configured upstream: a vLLM server serving `model` at `url`."""

    name: str
    url: str
    model: str
    labels: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({}), compare=False, hash=False
    )
    # `Authorization: Bearer <api_key>` on every request to it (vLLM's --api-key)
    api_key: str | None = field(default=None, repr=False, compare=False, hash=False)


@dataclass(frozen=True, slots=True)
class BackendStats:
    """One scrape of a backend's `/metrics`; replaced wholesale, never mutated."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    tpot_s: float | None = None  # mean inter-token latency over the last interval(s)
    ttft_s: float | None = None  # mean time to first token over the last interval(s)
    prefix_hit_rate: float | None = None
    queue_s: float | None = None  # mean time a request waited in the queue (interval)
    prefill_s_per_token: float | None = None  # prefill time / prompt tokens computed
    healthy: bool = False
    updated_at: float = 0.0


UNKNOWN_STATS = BackendStats()


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What the proxy knows about a request before it is routed."""

    request_id: str
    endpoint: Endpoint
    model: str
    prompt_text: str
    prompt_blocks: tuple[bytes, ...]  # cumulative prefix hashes of fixed-size blocks
    stream: bool
    max_tokens: int | None
    session: str | None = None
    slo_ms: float | None = None
    expected_tokens: int | None = None  # the client's length hint (header), if any
    arrived_at: float = 0.0
    # the client's own x-request-id (short and plain: proxy/requests.py), echoed to it;
    # never a key of the proxy's (two requests may send the same one)
    client_id: str | None = None

    @property
    def echo_id(self) -> str:
        """The `x-request-id` of the answer: the client's own, else `request_id`."""
        return self.client_id or self.request_id


@dataclass(frozen=True, slots=True)
class ClusterView:
    """What a policy may look at while picking.

    `candidates` are the healthy, non-draining backends serving the request's model
    (minus any already tried for this request). `stats` is the poller's latest
    snapshot; `inflight` is the proxy's exact count of open requests per backend,
    read synchronously inside `pick` so it cannot change under the policy.
    """

    candidates: tuple[Backend, ...]
    stats: Mapping[str, BackendStats]
    inflight: Mapping[str, int]
    now: float

    def stats_of(self, backend: Backend) -> BackendStats:
        return self.stats.get(backend.name, UNKNOWN_STATS)

    def inflight_of(self, backend: Backend) -> int:
        return self.inflight.get(backend.name, 0)


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's answer: where to send the request, and why (for logs).

    `drop` set: the policy refuses the request (qos_drl's drop action); the client gets
    a 503 `request_dropped` with this text, `backend` is not contacted."""

    backend: Backend
    reason: str = ""
    drop: str | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to a routed request; fed back to the policy and to metrics."""

    request_id: str
    model: str
    backend: str
    policy: str
    status: int
    ok: bool
    started_at: float
    ttft_s: float | None
    e2e_s: float
    completion_tokens: int
    prompt_tokens: int | None = None
    tpot_s: float | None = None
    moved_to: str | None = None  # this leg handed the request over to another backend
    migrations: int = 0  # handoffs before this leg (0: the request never moved)


@dataclass(frozen=True, slots=True)
class Progress:
    """A running stream, as a policy's periodic migration check sees it."""

    backend: Backend  # where it runs now
    generated: int  # tokens generated so far (on every backend)
    max_tokens: int | None
    elapsed_s: float  # since the request arrived
    ttft_s: float | None
    tpot_s: float | None  # mean seconds per token on the current backend
    migrations: int
