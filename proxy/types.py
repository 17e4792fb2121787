"""Immutable values that flow along the request path (see DESIGN.md).

Every arrow of the request path carries one of these. They are frozen so that a
policy can never reach back and change what the proxy or the poller observed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

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
class SloTarget:
    """A request's SLO class as configured (`slo_classes`, docs/slice.md): what a
    backend running the SLICE scheduler is told, and what the class's metrics judge
    the relayed stream by. Fixed at admission, so a reload never changes it mid-way."""

    name: str
    tpot_ms: float
    utility: float
    priority: int = 0  # vLLM's `priority`: lower runs first
    ttft_ms: float | None = None  # non-real-time classes: TTFT and TPOT bounds
    deadline_ms: float | None = None  # real-time classes: end to end


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
    # the client's own x-request-id (short and plain: proxy/request_context.py), echoed to it;
    # never a key of the proxy's (two requests may send the same one)
    client_id: str | None = None
    slo_class: SloTarget | None = None  # set at admission when `slo_classes` are on

    # the client's cost budget (x-laneway-budget): the share of prompt tokens the
    # constrained side may process, in [0, 1] (DiSCo's b; policies/disco)
    budget: float | None = None
    # how fast the client reads, tokens/s (x-laneway-read-rate; 0: a machine reader)
    read_rate: float | None = None
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
class Hedge:
    """A delayed second leg of the same request (DiSCo's race, policies/disco): start it
    on `backend` `delay_s` seconds after the first leg unless the first leg has produced
    a token by then; whichever leg streams a token first continues, the other is
    aborted. `delay_s` 0: both legs start at once."""

    backend: Backend
    delay_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's answer: where to send the request, and why (for logs).

    `drop` set: the policy refuses the request (qos_drl's drop action); the client gets
    a 503 `request_dropped` with this text, `backend` is not contacted.
    `hedge` set: also race a delayed second leg (proxy/relay/race.py); each leg that
    started is observed once (the loser as an aborted 499)."""

    backend: Backend
    reason: str = ""
    drop: str | None = None
    hedge: Hedge | None = None


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


@dataclass(frozen=True, slots=True, eq=False)
class LengthPrior:
    """What a length predictor's arrival predictions are worth, from its artifact: the
    (predicted, true) output lengths of answers the predicting model was not trained
    on (`laneway train length --calibration-folds`: each training prompt predicted by a
    model fitted on the other folds). A policy that calibrates lengths
    (`predictors/length/calibration.py`) starts from these instead of from nothing. One object
    per predictor key, shared by every prediction of that key."""

    key: str
    samples: tuple[tuple[float, int], ...]


@dataclass(frozen=True, slots=True)
class Prediction:
    """A request's predicted cost. Empty when no predictor is configured.

    `output_tokens` is the predicted *total* output length, also mid-stream (tokens
    generated so far + tokens still to come), so a policy reads one meaning from
    every call: remaining = output_tokens - progress.generated.
    """

    output_tokens: float | None = None
    # the length predictor's out-of-fold (predicted, true) lengths, when its artifact has them
    length_prior: LengthPrior | None = None
    # ELDR: the request's expert signature (unit vector, predictors/eldr/experts.py), known
    # after a prefill leg on an MoE backend with the laneway_eldr plugin.
    expert_signature: tuple[float, ...] | None = None
    # qos_drl: per expert of the bucket predictor, the predicted generation score and
    # output length (bucket midpoints), computed off the event loop (proxy/routing/stages.py);
    # () when the predictor failed or timed out.
    expert_scores: tuple[float, ...] | None = None
    expert_lengths: tuple[float, ...] | None = None
    # kv_aware: per candidate with KV events, the prompt's leading tokens its KV cache holds
    # (exact, from its events; proxy/routing/kv_prefix_stage.py); a candidate without events is
    # absent; None when the stage did not run or could not tokenize the prompt.
    cached_prefix_tokens: Mapping[str, int] | None = None


NO_PREDICTION = Prediction()


# Stages a policy declares: asynchronous work between a request's prediction and its
# pick, which the proxy builds and runs (proxy/routing/stage_builder.py), so the proxy
# never asks which policy it runs.
@dataclass(frozen=True, slots=True)
class PrefillSignature:
    """A prefill leg on a `role: prefill` backend before the pick, whose routed-expert
    counts become `Prediction.expert_signature` (ELDR in PD mode;
    proxy/routing/eldr_stage.py)."""

    kv_transfer: bool  # hand the prefilled KV to the decode backend (kv_transfer_params)
    counts_shape: tuple[int, int]  # (layers, experts) of the routed-expert counts
    signature: Callable[[Any], tuple[float, ...]]  # counts (numpy array) -> signature


@dataclass(frozen=True, slots=True)
class BatchedBuckets:
    """Per-expert score and length buckets from a batch predictor run off the event loop,
    into `Prediction.expert_scores` / `expert_lengths` (qos_drl; proxy/routing/stages.py)."""

    predictor: Any  # predict_batch(prompts) -> [BucketPrediction], in a worker thread
    max_batch: int
    timeout_s: float


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """The prompt tokenized as the backend does (its `/tokenize`, chat template applied),
    hashed into vLLM's block chain and looked up in the exact index of each candidate's
    KV events, into `Prediction.cached_prefix_tokens` (kv_aware;
    proxy/routing/kv_prefix_stage.py)."""

    tokenize_timeout_s: float  # past it the field stays None and the policy approximates


StageSpec = PrefillSignature | BatchedBuckets | CachedPrefix
