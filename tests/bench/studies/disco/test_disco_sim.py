"""A tiny run of the DiSCo simulator: shape and invariants."""

from __future__ import annotations

from typing import Any

import pytest

from bench.studies.disco.sim import (
    PROFILES,
    SERVERS,
    STRATEGIES,
    load_workload,
    run_grid,
    summarize,
)
from predictors.home import DATASETS


@pytest.fixture(scope="module")
def cells() -> list[dict[str, Any]]:
    return run_grid(load_workload(DATASETS), seeds=2, requests=300, window=500,
                    budgets=(0.1, 0.5), profiles=PROFILES[:1], servers=SERVERS[1:2])


def test_one_cell_per_side_strategy_and_budget(cells: list[dict[str, Any]]) -> None:
    assert len(cells) == 2 * len(STRATEGIES) * 2
    keys = {(c["constrained"], c["strategy"], c["budget"]) for c in cells}
    assert len(keys) == len(cells)


def test_single_endpoint_baselines_never_touch_the_other_side(
        cells: list[dict[str, Any]]) -> None:
    for cell in cells:
        if cell["strategy"] == "server_only":
            assert cell["device_share"] == 0.0 and cell["server_share"] == 1.0
        if cell["strategy"] == "device_only":
            assert cell["server_share"] == 0.0 and cell["device_share"] == 1.0


def test_disco_spends_its_budget_and_migration_only_lowers_cost(
        cells: list[dict[str, Any]]) -> None:
    index = {(c["constrained"], c["strategy"], c["budget"]): c for c in cells}
    for side in ("device", "server"):
        for budget in (0.1, 0.5):
            disco = index[(side, "disco", budget)]
            plain = index[(side, "disco_no_migration", budget)]
            assert disco["budget_used"] == pytest.approx(budget, abs=0.05)
            assert disco["ttft_p99_s"] == plain["ttft_p99_s"]  # migration is after TTFT
            assert disco["cost_usd_per_1k"] <= plain["cost_usd_per_1k"]
            assert plain["migrated_share"] == 0.0
    summary = summarize(cells)
    assert set(summary) == {"disco_d", "disco_s"}
    tbt = summary["disco_d"]["playback_tbt_p99_s"]
    assert tbt is None or tbt >= 1 / 5.0 - 1e-9  # nobody reads faster than r_c
