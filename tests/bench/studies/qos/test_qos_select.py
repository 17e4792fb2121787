"""bench.studies.qos.select: every kept checkpoint of a run is evaluated on the same draws and
the one with the highest mean QoS becomes selected.pt."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.studies.qos.select import main
from bench.studies.qos.train import train
from tests.bench.studies.qos.test_qos_train import DATA


def test_the_run_s_checkpoints_are_ranked_on_a_larger_evaluation(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train(argparse.Namespace(
        data=DATA, buckets=tmp_path / "none", out=run, baseline=True, steps=200,
        minutes=5.0, fleet="tiny", rate=1.0, limit_ms=10.0, episode=100, warmup=50,
        batch=16, update_every=4, buffer=1000, eval_every=40, eval_arrivals=8,
        resume=False, seed=0, threads=1, speed_jitter=0.0, bucket_estimate="midpoint",
        speed=1.0, keep_best=2)) == 0
    assert len(list((run / "top").glob("step-*.pt"))) == 2
    assert main([str(run), "--data", str(DATA), "--buckets", str(tmp_path / "none"),
                 "--arrivals", "12", "--seeds", "1", "2"]) == 0
    result = json.loads((run / "selection.json").read_text())
    rows = result["candidates"]
    steps = [row["steps"] for row in rows]
    assert steps == sorted(set(steps)) and 200 in steps  # last.pt, once per step
    assert all(len(row["qos"]) == 2 for row in rows)
    best = max(rows, key=lambda row: row["mean_qos"])
    assert result["selected"] == best
    name = best["checkpoint"]
    assert (run / "selected.pt").read_bytes() == (run / name).read_bytes()
