"""Per-request latency of the length predictor, as the proxy calls it.

One request at a time on one thread, like the proxy's request path: TF-IDF encoding +
the fused MoE forward pass, timed with `perf_counter_ns` around `predict` /
`predict_window` (`laneway evaluate length` records the numbers in
docs/results/length_predictor.json; `python -m bench.studies.predictor_latency` prints them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from predictors.base import Predictor
from proxy.types import RequestContext

WINDOW_CHARS = 1500  # mid-stream calls see this much answer text (~250 tiny-BPE tokens)


def context(model: str, prompt: str, index: int) -> RequestContext:
    return RequestContext(request_id=f"bench-{index}", endpoint="chat", model=model,
                          prompt_text=prompt, prompt_blocks=(), stream=True, max_tokens=None)


def measure(predictor: Predictor, model: str, prompts: Sequence[str], answers: Sequence[str],
            repeats: int = 5) -> dict[str, float]:
    """p50/p99 in ms of `predict` and of `predict_window` over `prompts` x `repeats`."""
    contexts = [context(model, p, i) for i, p in enumerate(prompts)]
    windows = [(ctx, a[:WINDOW_CHARS], len(a[:WINDOW_CHARS].split()))
               for ctx, a in zip(contexts, answers, strict=True)]
    arrival = _timed([partial(predictor.predict, c) for c in contexts], repeats)
    window = _timed([partial(predictor.predict_window, *w) for w in windows], repeats)
    return {"predict_p50_ms": _pct(arrival, 50), "predict_p99_ms": _pct(arrival, 99),
            "window_p50_ms": _pct(window, 50), "window_p99_ms": _pct(window, 99),
            "calls": float(len(arrival))}


def _timed(calls: Sequence[Callable[[], object]], repeats: int) -> list[int]:
    for call in calls:  # warm-up: first-call allocations, caches
        call()
    samples: list[int] = []
    for _ in range(repeats):
        for call in calls:
            start = time.perf_counter_ns()
            call()
            samples.append(time.perf_counter_ns() - start)
    return samples


def _pct(samples_ns: Sequence[int], q: float) -> float:
    return round(float(np.percentile(np.asarray(samples_ns), q)) / 1e6, 4)
