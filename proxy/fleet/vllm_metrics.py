"""Parse the few vLLM `/metrics` families the router needs into `BackendStats`.

vLLM exports hundreds of lines (mostly histogram buckets); we read only the lines
whose name we need and sum them across label sets (several engines per server).
Histograms give means over the last scrape interval from deltas of `_sum`/`_count`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from proxy.types import BackendStats

# vLLM renamed some families across versions; the first name found wins.
_RUNNING = ("vllm:num_requests_running",)
_WAITING = ("vllm:num_requests_waiting",)
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_TTFT = ("vllm:time_to_first_token_seconds",)
_TPOT = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
_PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
_PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
_QUEUE = ("vllm:request_queue_time_seconds",)
_PREFILL = ("vllm:request_prefill_time_seconds",)
_PREFILL_TOKENS = ("vllm:request_prefill_kv_computed_tokens",)  # prompt minus cache hits


def _suffixed(names: tuple[str, ...], suffix: str) -> tuple[str, ...]:
    return tuple(f"{n}_{suffix}" for n in names)


_TTFT_SUM, _TTFT_COUNT = _suffixed(_TTFT, "sum"), _suffixed(_TTFT, "count")
_TPOT_SUM, _TPOT_COUNT = _suffixed(_TPOT, "sum"), _suffixed(_TPOT, "count")
_QUEUE_SUM, _QUEUE_COUNT = _suffixed(_QUEUE, "sum"), _suffixed(_QUEUE, "count")
_PREFILL_SUM, _PREFILL_TOKENS_SUM = _suffixed(_PREFILL, "sum"), _suffixed(_PREFILL_TOKENS, "sum")

# Alias groups, current name first; only the first name present is read.
_GROUPS: tuple[tuple[str, ...], ...] = (
    _RUNNING, _WAITING, _KV_USAGE, _PREFIX_HITS, _PREFIX_QUERIES, _TTFT_SUM, _TTFT_COUNT,
    _TPOT_SUM, _TPOT_COUNT, _QUEUE_SUM, _QUEUE_COUNT, _PREFILL_SUM, _PREFILL_TOKENS_SUM,
)
# Every sample name read, for the scrape's `?name[]=` filter (`proxy/fleet/scrape.py`).
WANTED: tuple[str, ...] = tuple(name for group in _GROUPS for name in group)


def parse_samples(text: str) -> dict[str, float]:
    """Sum of every wanted sample over its label sets, by metric name.

    A filtered page (a few KB, `proxy/fleet/scrape.py`) is read line by line. vLLM's whole
    page is ~50 KB of which we need a dozen lines: there, jump to each wanted family
    with `str.find` (a family's samples are contiguous in Prometheus text) instead.
    """
    if len(text) <= _LINE_SCAN_MAX:
        return _scan_lines(text)
    text = "\n" + text
    totals: dict[str, float] = {}
    for group in _GROUPS:
        for name in group:
            at = _find_sample(text, name, 0)
            if at < 0:
                continue
            total = 0.0
            while at >= 0:
                end = text.find("\n", at + 1)
                line = text[at + 1 : end if end >= 0 else len(text)]
                with contextlib.suppress(ValueError, IndexError):
                    total += float(line[line.rfind("}") + 1 :].split()[0])
                at = end if end >= 0 and _is_sample(text, name, end) else -1
            totals[name] = total
            break
    return totals


_LINE_SCAN_MAX = 8192
_WANTED_SET = frozenset(WANTED)


def _scan_lines(text: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in text.split("\n"):
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        name = line[:brace] if brace >= 0 else line[:line.find(" ")]
        if name in _WANTED_SET:
            try:
                found[name] = found.get(name, 0.0) + float(
                    line[line.rfind("}") + 1:].split()[0])
            except (ValueError, IndexError):
                continue
    # An alias group counts only its first name present, as the find-based path does.
    totals: dict[str, float] = {}
    for group in _GROUPS:
        for name in group:
            if name in found:
                totals[name] = found[name]
                break
    return totals


def _is_sample(text: str, name: str, newline: int) -> bool:
    """Whether the line after `newline` is a sample of exactly `name`."""
    after = newline + 1 + len(name)
    return text.startswith(name, newline + 1) and after < len(text) and text[after] in "{ "


def _find_sample(text: str, name: str, start: int) -> int:
    """Index of the newline before the first sample of `name` (-1 if none)."""
    at = text.find("\n" + name, start)
    while at >= 0 and not _is_sample(text, name, at):
        at = text.find("\n" + name, at + 1)
    return at


def _first(samples: dict[str, float], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in samples:
            return samples[name]
    return None


@dataclass(frozen=True, slots=True)
class Cumulative:
    """Cumulative counters kept between scrapes to compute interval means."""

    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    tpot_sum: float = 0.0
    tpot_count: float = 0.0
    prefix_hits: float = 0.0
    prefix_queries: float = 0.0
    queue_sum: float = 0.0
    queue_count: float = 0.0
    prefill_sum: float = 0.0
    prefill_tokens: float = 0.0


def _interval_mean(
    new_sum: float, new_count: float, old_sum: float, old_count: float, last: float | None
) -> float | None:
    # A counter that went down means the server restarted: start over.
    if new_count < old_count:
        old_sum, old_count = 0.0, 0.0
    if new_count > old_count:
        return (new_sum - old_sum) / (new_count - old_count)
    return last  # nothing new finished this interval: keep the last estimate


def to_stats(
    samples: dict[str, float], prev: Cumulative, last: BackendStats, now: float
) -> tuple[BackendStats, Cumulative]:
    """Build the next snapshot from one scrape and the previous cumulative counters."""
    cum = Cumulative(
        ttft_sum=_first(samples, _TTFT_SUM) or 0.0,
        ttft_count=_first(samples, _TTFT_COUNT) or 0.0,
        tpot_sum=_first(samples, _TPOT_SUM) or 0.0,
        tpot_count=_first(samples, _TPOT_COUNT) or 0.0,
        prefix_hits=_first(samples, _PREFIX_HITS) or 0.0,
        prefix_queries=_first(samples, _PREFIX_QUERIES) or 0.0,
        queue_sum=_first(samples, _QUEUE_SUM) or 0.0,
        queue_count=_first(samples, _QUEUE_COUNT) or 0.0,
        prefill_sum=_first(samples, _PREFILL_SUM) or 0.0,
        prefill_tokens=_first(samples, _PREFILL_TOKENS_SUM) or 0.0,
    )
    queries = cum.prefix_queries - prev.prefix_queries
    hit_rate = last.prefix_hit_rate
    if queries > 0:
        hit_rate = (cum.prefix_hits - prev.prefix_hits) / queries
    stats = BackendStats(
        running=int(_first(samples, _RUNNING) or 0),
        waiting=int(_first(samples, _WAITING) or 0),
        kv_usage=_first(samples, _KV_USAGE) or 0.0,
        ttft_s=_interval_mean(
            cum.ttft_sum, cum.ttft_count, prev.ttft_sum, prev.ttft_count, last.ttft_s
        ),
        tpot_s=_interval_mean(
            cum.tpot_sum, cum.tpot_count, prev.tpot_sum, prev.tpot_count, last.tpot_s
        ),
        prefix_hit_rate=hit_rate,
        queue_s=_interval_mean(
            cum.queue_sum, cum.queue_count, prev.queue_sum, prev.queue_count, last.queue_s
        ),
        prefill_s_per_token=_interval_mean(
            cum.prefill_sum, cum.prefill_tokens, prev.prefill_sum, prev.prefill_tokens,
            last.prefill_s_per_token,
        ),
        healthy=True,
        updated_at=now,
    )
    return stats, cum
