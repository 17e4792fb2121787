"""The Mooncake-derived server TTFT distribution (bench/studies/disco/mooncake_ttft.py)
and its use in the DiSCo simulator."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from bench.studies.disco.mooncake_ttft import knee, load_trace, replay
from bench.studies.disco.sim import EmpiricalTtft
from predictors.home import DATASETS


def test_the_knee_is_the_first_load_at_twice_the_unloaded_median() -> None:
    assert knee({1.0: 0.5, 2.0: 0.8, 3.0: 1.0, 4.0: 3.0}) == 3.0
    assert knee({1.0: 0.5, 2.0: 0.9}) is None  # not reached yet: climb the ladder


def test_replay_times_every_request_and_queues_grow_with_the_load() -> None:
    trace = load_trace(DATASETS, 40)
    assert len(trace) == 40 and all(r.input_tokens > 0 for r in trace)
    light, heavy = replay(trace, 1.0, gpus=2), replay(trace, 200.0, gpus=2)
    assert len(light) == len(heavy) == 40 and min(light) > 0
    # 200x closer arrivals on two engines: requests wait behind each other's prefills
    assert statistics.median(heavy) > 2 * statistics.median(light)


def test_shared_trace_prefixes_hit_the_emulated_prefix_cache() -> None:
    """Requests whose hash ids repeat (one conversation's turns) compute fewer tokens:
    the same trace with every hash id made unique takes longer to prefill."""
    trace = load_trace(DATASETS, 60)
    shared = sum(len(r.hash_ids) for r in trace) - len({h for r in trace for h in r.hash_ids})
    assert shared > 0  # the trace does share prefixes
    unique = [r.__class__(r.arrival_s, tuple(range(i * 1000, i * 1000 + len(r.hash_ids))),
                          r.input_tokens, r.output_tokens) for i, r in enumerate(trace)]
    assert sum(replay(trace, 1.0, gpus=1)) < sum(replay(unique, 1.0, gpus=1))


def test_the_simulator_draws_only_measured_ttfts(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    path.write_text(json.dumps({"ttft_s": [0.2, 0.5, 3.0]}))
    source = EmpiricalTtft.load(path)
    drawn = source.draw(np.random.default_rng(0), 1000)
    assert set(drawn.tolist()) == {0.2, 0.5, 3.0} and source.name == "mooncake-emulated"
