"""bench/studies/tracing_ab.py end to end on small numbers: both proxies serve, every span of
the traced one reaches the receiver process, and the in-process cost is measured."""

from __future__ import annotations

import json
from pathlib import Path

from bench.studies import tracing_ab


def test_the_ab_runs_and_every_traced_requests_spans_arrive(tmp_path: Path) -> None:
    out = tmp_path / "tracing.json"
    assert tracing_ab.main(["--rounds", "2", "--requests", "40", "--streams", "4",
                            "--tokens", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for side in ("untraced", "traced"):
        assert result[side]["requests"] == 2 * 40 and result[side]["p50_ms"] > 0
    # warm-up (40 // 4) + 2 blocks of 40 + 2 rounds of 4 streams, two spans each
    assert result["spans_received"] == {"spans": 2 * (10 + 80 + 8), "exports":
                                        result["spans_received"]["exports"], "refused": 0}
    assert 0 < result["in_process_cpu_us_per_request"] < 1000
