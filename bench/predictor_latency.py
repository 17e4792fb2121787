"""Per-request latency of the length predictor, as the proxy calls it.

`python -m bench.predictor_latency --artifact DIR` (or `laneway evaluate length`,
which records the numbers in docs/results/length_predictor.json). One request at a
time on one thread, like the proxy's request path: TF-IDF encoding + the fused MoE
forward pass, timed with `perf_counter_ns` around `predict` / `predict_window`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

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


def main() -> None:
    from bench.tiny_models import DEFAULT_SHARED
    from predictors.length import load_artifact
    from predictors.length_data import chat_prompt, is_heldout

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--artifact", required=True, type=Path)
    parser.add_argument("--data", type=Path,
                        default=DEFAULT_SHARED / "data" / "alpaca_eval_experts.jsonl")
    parser.add_argument("--model", default="gpt-3.5-turbo-1106", help="predictor key")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import json

    records = [json.loads(line) for line in args.data.open()]
    held = [r for r in records if is_heldout(int(r["id"]))]
    prompts = [chat_prompt(r["instruction"]) for r in held]
    answers = [r["experts"][args.model]["output"] for r in held]
    result = measure(load_artifact(args.artifact), args.model, prompts, answers, args.repeats)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
