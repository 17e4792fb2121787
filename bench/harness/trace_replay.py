"""Mooncake trace replay: real arrival times, prefixes shared as the trace shares them.

Each trace line has `timestamp` (ms), `input_length`, `output_length` and `hash_ids`,
one per 512-token block of the prompt; equal ids mean an equal (cacheable) prefix.
The replay keeps arrivals (times `time_scale`, from the first selected line), and
builds each prompt as the concatenation of one text block per hash id, the same text
for the same id, cut to the prompt's scaled length. Lengths are divided by one factor
(blocks shrink to 512/factor tokens, so block structure and the shape of the length
distribution are kept) and clipped to the context by `LengthFit`. The automatic
factor makes the 90th percentile of prompt + output of the selected lines fit; any
factor is then rounded so that a block becomes a whole number of tokens (512/factor).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench.harness.workloads import LengthFit, Workload, WorkloadRequest, WorkloadSpec
from bench.models.lexicon import Lexicon
from predictors.home import open_text

TRACE_BLOCK_TOKENS = 512
AUTO_QUANTILE = 90


def trace_path(spec: WorkloadSpec) -> Path:
    named = spec.shared / "traces" / f"mooncake_{spec.trace}.jsonl"
    return named if named.exists() or "/" not in spec.trace else Path(spec.trace)


def select(path: Path, spec: WorkloadSpec) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) of the lines replayed: from `start_s`, at most n, in duration."""
    chosen: list[tuple[int, dict[str, Any]]] = []
    first_ms: float | None = None
    with open_text(path) as f:
        for number, line in enumerate(f):
            row = orjson.loads(line)
            if row["timestamp"] < spec.start_s * 1000:
                continue
            first_ms = row["timestamp"] if first_ms is None else first_ms
            at = (row["timestamp"] - first_ms) / 1000 * spec.time_scale
            if len(chosen) >= spec.n or (spec.duration_s is not None and at > spec.duration_s):
                break
            chosen.append((number, {**row, "arrival_s": at}))
    return chosen


def auto_scale(rows: list[dict[str, Any]], fit: LengthFit) -> float:
    totals = [r["input_length"] + r["output_length"] for r in rows]
    needed = float(np.percentile(totals, AUTO_QUANTILE)) if totals else 1.0
    return max(1.0, needed / (fit.context - fit.margin))


def replay(spec: WorkloadSpec, lexicon: Lexicon) -> Workload:
    path = trace_path(spec)
    chosen = select(path, spec)
    wanted_scale = spec.fit.scale or auto_scale([row for _, row in chosen], spec.fit)
    # A 512-token block must become a whole number of tokens: round the factor so.
    block_tokens = max(1, round(TRACE_BLOCK_TOKENS / wanted_scale))
    scale = TRACE_BLOCK_TOKENS / block_tokens
    fit = replace(spec.fit, scale=scale, output_scale=spec.fit.output_scale or scale)
    blocks: dict[int, list[str]] = {}
    requests = []
    for seq, (number, row) in enumerate(chosen):
        hash_ids: list[int] = row["hash_ids"]
        wanted = min(max(1, round(row["input_length"] / scale)), block_tokens * len(hash_ids))
        prompt_tokens, max_tokens = fit.clip(
            wanted, max(1, round(row["output_length"] / (fit.output_scale or scale))))
        words: list[str] = []
        for hash_id in hash_ids[:math.ceil(prompt_tokens / block_tokens)]:
            words += _block(blocks, hash_id, block_tokens, spec.seed, lexicon)
        prompt = "".join(" " + w for w in words[:prompt_tokens])
        requests.append(WorkloadRequest(
            seq, f"{path.stem}-{number}", row["arrival_s"], prompt, prompt_tokens, max_tokens,
            path.stem))
    meta = {"kind": "trace", "trace": str(path), "seed": spec.seed,
            "time_scale": spec.time_scale, "start_s": spec.start_s,
            "block_tokens": block_tokens, "lexicon": lexicon.name,
            "exact_lengths": lexicon.exact, "fit": asdict(fit)}
    return Workload(meta, tuple(requests))


def _block(cache: dict[int, list[str]], hash_id: int, tokens: int, seed: int,
           lexicon: Lexicon) -> list[str]:
    """The words of one prefix block: a function of (seed, hash id) only."""
    if hash_id not in cache:
        rng = random.Random(f"{seed}:{hash_id}")
        cache[hash_id] = [rng.choice(lexicon.words) for _ in range(tokens)]
    return cache[hash_id]
