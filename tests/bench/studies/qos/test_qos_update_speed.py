"""bench.studies.qos.update_speed: both HANs are timed on the same simulated states."""

from __future__ import annotations

import json
from pathlib import Path

from bench.studies.qos.update_speed import main
from tests.bench.studies.qos.test_qos_train import DATA


def test_packed_and_dense_updates_are_timed_on_simulated_states(tmp_path: Path) -> None:
    out = tmp_path / "speed.json"
    assert main(["--data", str(DATA), "--buckets", str(tmp_path / "none"), "--checkpoint",
                 str(tmp_path / "none.pt"), "--states", "60", "--batches", "2", "--batch",
                 "8", "--rounds", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["routed_by"] == "uniform over the experts" and result["states"] == 60
    for kind in ("packed", "dense"):
        assert len(result["rounds"][kind]["update"]) == 2  # the warm-up round is not kept
        assert result["update_ms"][kind] > 0 and result["act_ms"][kind] > 0
    assert 0 < result["slot_fill"]["running"] < 1
    assert result["update_speedup"] > 0
