"""ELDR bench helpers: the prompt set and the batch-matched active-expert metric."""

from __future__ import annotations

from collections import Counter

import numpy as np

from bench.studies.eldr.prompts import domain_prompts
from bench.studies.eldr.real import BATCHES, PolicyRun
from bench.studies.eldr.report import batch_matched
from predictors.home import DATASETS


def test_prompts_cover_the_task_domains_evenly() -> None:
    pairs = domain_prompts(DATASETS, 5)
    counts = Counter(domain for domain, _ in pairs)
    assert {"prose", "code", "math"} <= set(counts) and set(counts.values()) == {5}
    assert all(text.strip() for _, text in pairs)


def run(steps: list[int], active_per_step: list[float]) -> PolicyRun:
    steps_by_batch = np.zeros(BATCHES)
    steps_by_batch[: len(steps)] = steps
    active_by_batch = np.zeros(BATCHES)
    active_by_batch[: len(steps)] = np.array(steps) * np.array(active_per_step)
    totals = [steps_by_batch.sum(), active_by_batch.sum(), 0.0]
    return PolicyRun(np.concatenate([totals, steps_by_batch, active_by_batch]), [], [], [])


def test_batch_matched_compares_unions_at_equal_batch_sizes() -> None:
    # Policy a runs mostly small batches, b mostly large: raw means would favour a,
    # but at every batch size b's union is smaller.
    a = run([0, 100, 20], [0.0, 2.0, 4.0])
    b = run([0, 20, 100], [0.0, 1.5, 3.0])
    matched = batch_matched({"a": a, "b": b})
    assert matched["b"] < matched["a"]
    assert matched["a"] == (120 * 2.0 + 120 * 4.0) / 240


def test_runs_merge_by_summing_counters() -> None:
    a, b = run([0, 10], [0.0, 2.0]), run([0, 30], [0.0, 4.0])
    assert a.merged(b).active_experts == (20 + 120) / 40
