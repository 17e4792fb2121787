import json
from pathlib import Path

import pytest

from bench.studies.qos.sim import TraceArrivals, trace_times
from bench.studies.qos.trace import burstiness, summarize


def test_summary_gains_are_of_the_draw_means_and_ignore_the_sampled_actor() -> None:
    row = summarize({"qos_drl": [0.5, 0.7], "qos_drl_sampled": [0.9, 0.9],
                     "baseline_rl": [0.4, 0.6], "round_robin": [0.2, 0.2]})
    assert row["gain_vs_baseline_rl"] == pytest.approx(0.6 / 0.5 - 1)
    assert row["gain_vs_baseline_rl_draws"] == pytest.approx([0.25, 0.7 / 0.6 - 1])
    assert row["best_other"] == "baseline_rl" and row["beats_every_baseline"]
    behind = summarize({"qos_drl": [0.3], "baseline_rl": [0.4], "round_robin": [0.2]})
    assert not behind["beats_every_baseline"] and behind["gain_vs_baseline_rl"] < 0


def test_trace_times_are_seconds_and_bursts_are_burstier(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 3000 * (i // 6), "input_length": 1,
                                        "output_length": 1, "hash_ids": []}) + "\n"
                            for i in range(600)))
    times = trace_times(path)
    assert times[:7] == (0, 0, 0, 0, 0, 0, 3.0) and len(times) == 600
    spread, bursts = (burstiness(TraceArrivals(times, 300, spread=s), 7, 5.0)
                      for s in (True, False))
    assert spread is not None and bursts is not None
    assert spread < 1 < 2 < bursts  # Poisson: 1
    assert burstiness(None, 7, 5.0) is None
