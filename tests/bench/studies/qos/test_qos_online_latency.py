"""bench.studies.qos.online_latency: every mode decides, only the online ones train."""

from __future__ import annotations

import json
from pathlib import Path

from bench.studies.qos.online_latency import main
from tests.policies.qos_drl.test_qos_drl import checkpoint


def test_each_mode_is_timed_and_only_the_online_ones_update(tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    assert main(["--checkpoint", str(checkpoint(tmp_path, 1)), "--decisions", "30",
                 "--rate", "200", "--warmup", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["off"]["updates"] == 0
    # one update per transition from the 4th (29 transitions), inline or in the thread
    assert result["inline"]["updates"] == result["thread"]["updates"] == 26
    for mode in ("off", "inline", "thread"):
        assert 0 < result[mode]["p50_ms"] <= result[mode]["p99_ms"]
