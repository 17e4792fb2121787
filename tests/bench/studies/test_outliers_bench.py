"""bench/studies/outliers.py end to end on two fake vLLM processes: every cell runs, no client
sees an error, and passive health keeps attempts off the broken server."""

from __future__ import annotations

import json
from pathlib import Path

from bench.studies import outliers


def test_the_bench_runs_each_failure_with_passive_health_off_and_on(tmp_path: Path) -> None:
    out = tmp_path / "outliers.json"
    # 40 a round: the broken server's fifth failure comes within them on a loaded machine
    # too (least_request sent it 4 of 20 in one CI round: its failed attempts count as
    # open until their retry elsewhere ends)
    assert outliers.main(["--fake", "2", "--requests", "40", "--rounds", "2", "--max-tokens", "8",
                          "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    cells = result["cells"]
    assert sorted(cells) == sorted(f"{n}/{m}" for n in outliers.FAILURES
                                   for m in ("off", "on"))
    assert result["no_client_errors"] and result["ejection_spares_the_broken_server"]
    for key, cell in cells.items():
        assert cell["requests"] == 80 and cell["errors"] == 0, (key, cell)  # both rounds
    for name in ("5xx", "cut"):
        assert cells[f"{name}/off"]["ejections"] == 0
        # ejected at its fifth failure in each round (a fresh proxy); requests already
        # sent there may fail after
        assert cells[f"{name}/on"]["ejections"] == 2
        assert cells[f"{name}/on"]["reached_broken"] <= 2 * (5 + 4)
    assert cells["cut/on"]["migrations"] == cells["cut/on"]["reached_broken"]
    assert cells["healthy/off"]["reached_broken"] == 0
    assert "| 5xx | on | 0 / 80 |" in result["table"]
