"""What the fake vLLM engine counts, and its `/metrics` in vLLM's Prometheus text.

Names, label sets (sorted, as prometheus_client prints them), HELP texts and bucket
bounds are vLLM 0.32's; values are what really runs in the fake.
"""

from __future__ import annotations

import bisect
import urllib.parse
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
PREFIX_BLOCK = 16  # tokens per KV block, as vLLM's default block size
_PREFIX_CAPACITY = 200_000  # cached block hashes before the cache is reset
_BODIES_KEPT = 1000


class Histogram:
    __slots__ = ("bounds", "buckets", "count", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.buckets = [0] * (len(bounds) + 1)  # per bucket, not cumulative; last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.buckets[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


class PrefixCache:
    """Which prompt blocks were seen before: vLLM's prefix-cache hit accounting."""

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def lookup(self, prompt_ids: list[int]) -> int:
        """Cached tokens of this prompt (leading full blocks seen before); caches it."""
        if len(self._seen) > _PREFIX_CAPACITY:
            self._seen.clear()
        block_hash, hits, missed = 0, 0, False
        for start in range(0, len(prompt_ids) - PREFIX_BLOCK + 1, PREFIX_BLOCK):
            block_hash = hash((block_hash, *prompt_ids[start:start + PREFIX_BLOCK]))
            if not missed and block_hash in self._seen:
                hits += PREFIX_BLOCK
            else:
                missed = True
                self._seen.add(block_hash)
        return hits


@dataclass(slots=True)
class FakeStats:
    """Mutable counters of one fake server; tests read them directly."""

    requests: int = 0  # completion requests received (including failed ones)
    running: int = 0
    waiting: int = 0
    peak: int = 0  # the most completion requests held at once (running + waiting)
    finished: int = 0
    cancelled: int = 0  # the client went away before the end
    dropped: int = 0  # connections cut on purpose (die_after_tokens)
    kv_tokens: int = 0  # prompt + generated tokens held by running requests
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    keep_bodies: bool = True  # off where nobody reads them (the emulator's fleets)
    bodies: list[dict[str, Any]] = field(default_factory=list)  # the most recent ones
    tokenized: list[dict[str, Any]] = field(default_factory=list)  # /tokenize bodies
    # Authorization (else "x-api-key <key>") of each /v1/* request, None without either
    credentials: list[str | None] = field(default_factory=list)
    traceparents: list[str | None] = field(default_factory=list)  # ... their traceparent
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))

    @property
    def last_body(self) -> dict[str, Any] | None:
        return self.bodies[-1] if self.bodies else None

    def record_credentials(self, authorization: str | None,
                           traceparent: str | None = None) -> None:
        if self.keep_bodies:
            del self.credentials[:-_BODIES_KEPT]
            self.credentials.append(authorization)
            del self.traceparents[:-_BODIES_KEPT]
            self.traceparents.append(traceparent)

    def record(self, body: dict[str, Any]) -> None:
        self.requests += 1
        if not self.keep_bodies:
            return
        if len(self.bodies) >= 2 * _BODIES_KEPT:
            del self.bodies[:_BODIES_KEPT]
        self.bodies.append(body)


_HELP = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:num_preemptions": "Cumulative number of preemption from the engine.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
}


def render(stats: FakeStats, model: str, kv_capacity_tokens: int,
           names: Collection[str] = ()) -> bytes:
    """vLLM's `/metrics` text; only the samples in `names` when given, as
    prometheus_client does for `?name[]=...`."""
    labels = f'engine="0",model_name="{model}"'
    out: list[str] = []

    def wanted(sample: str) -> bool:
        return not names or sample in names

    def family(name: str, kind: str, value: float) -> None:
        sample = f"{name}_total" if kind == "counter" else name
        if wanted(sample):
            out.append(f"# HELP {sample} {_HELP[name]}\n# TYPE {sample} {kind}\n"
                       f"{sample}{{{labels}}} {float(value)!r}\n")

    family("vllm:num_requests_running", "gauge", stats.running)
    family("vllm:num_requests_waiting", "gauge", stats.waiting)
    family("vllm:kv_cache_usage_perc", "gauge", min(1.0, stats.kv_tokens / kv_capacity_tokens))
    family("vllm:prefix_cache_queries", "counter", stats.prefix_queries)
    family("vllm:prefix_cache_hits", "counter", stats.prefix_hits)
    family("vllm:prompt_tokens", "counter", stats.prompt_tokens)
    family("vllm:generation_tokens", "counter", stats.generation_tokens)
    family("vllm:num_preemptions", "counter", stats.preemptions)
    for name, hist in (("vllm:time_to_first_token_seconds", stats.ttft),
                       ("vllm:inter_token_latency_seconds", stats.itl)):
        lines = []
        if wanted(f"{name}_bucket"):
            cumulative = 0
            for bound, count in zip((*map(repr, hist.bounds), "+Inf"), hist.buckets,
                                    strict=True):
                cumulative += count
                lines.append(f'{name}_bucket{{engine="0",le="{bound}",model_name="{model}"}} '
                             f"{float(cumulative)!r}\n")
        if wanted(f"{name}_count"):
            lines.append(f"{name}_count{{{labels}}} {float(hist.count)!r}\n")
        if wanted(f"{name}_sum"):
            lines.append(f"{name}_sum{{{labels}}} {hist.sum!r}\n")
        if lines:
            out += [f"# HELP {name} {_HELP[name]}\n# TYPE {name} histogram\n", *lines]
    return "".join(out).encode()


def requested_names(query_string: bytes) -> frozenset[str]:
    """The `name[]` values of a `/metrics` query (empty: everything)."""
    return frozenset(urllib.parse.parse_qs(query_string.decode("latin-1")).get("name[]", ()))
