"""The peer benchmark's harness (bench/studies/peers.py) with laneway alone: the peers live in
their own venv (`make bench STUDY=peers`), which the test suite does not install."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.studies import peers


def test_the_peer_bench_runs_laneway_and_writes_its_table(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    out = tmp_path / "peers.json"
    assert peers.main(["--targets", "laneway", "--quick", "--rounds", "1",
                       "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    (result,) = written["summary"]["laneway"]
    assert 0 < result["ttft_added_p50_ms"] < 50  # laneway really sat in between
    assert 0.3 < result["ratio_64"] < 1.5 and result["failed_streams_64"] == 0
    assert result["cpu_us_per_token_64"] is not None and result["cpu_us_per_token_64"] > 0
    assert "| laneway | +" in capsys.readouterr().out


def test_an_unknown_target_is_refused() -> None:
    with pytest.raises(SystemExit):
        peers.main(["--targets", "laneway,envoy"])
