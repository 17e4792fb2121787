"""bench/studies/scale.py: staleness arithmetic, added-latency pairing, result JSON shape."""

from __future__ import annotations

import pytest

from bench.studies.policy_latency import Row
from bench.studies.scale import LoadRow, overhead, percentiles_ms, results_json, snapshot_staleness


def test_staleness_is_the_oldest_healthy_snapshot() -> None:
    age = snapshot_staleness([9.0, 9.95, 5.0], [True, True, False], now=10.0)
    assert age == pytest.approx(1.0)  # the unhealthy backend's old stats do not count


def test_staleness_unknown_before_the_first_publish() -> None:
    assert snapshot_staleness([], [], now=1.0) is None
    assert snapshot_staleness([0.5], [False], now=1.0) is None


def test_percentiles_in_ms() -> None:
    summary = percentiles_ms([0.001 * i for i in range(1, 101)])
    assert summary["p50_ms"] == pytest.approx(50.5)
    assert summary["max_ms"] == pytest.approx(100.0)
    assert summary["samples"] == 100
    assert percentiles_ms([])["p99_ms"] == 0.0


def test_overhead_pairs_laneway_with_direct_at_the_same_rate() -> None:
    rows = [LoadRow(8, "direct", 250, 249, 0, 30.0, 40.0),
            LoadRow(8, "laneway", 250, 248, 0, 31.5, 45.0),
            LoadRow(8, "laneway", 500, 400, 0, 90.0, 900.0)]  # no direct twin: skipped
    assert overhead(rows) == [{"backends": 8, "offered_rps": 250, "achieved_rps_direct": 249,
                               "achieved_rps_laneway": 248, "added_p50_ms": 1.5,
                               "added_p99_ms": 5.0}]


def test_results_json_keys() -> None:
    decisions = [Row("goodput", 512, 10, 50.0, 104.0, 200.0, 60.0),
                 Row("goodput", 8, 10, 5.0, 20.0, 30.0, 6.0),
                 Row("random", 512, 10, 1.0, 2.0, 3.0, 1.0)]
    staleness = {8: {"static": {"100": {"p99_ms": 105.0}}},
                 512: {"static": {"100": {"p99_ms": 160.0}, "50": {"p99_ms": 90.0}},
                       "emulator": {"100": {"p99_ms": 700.0}}}}
    out = results_json(decisions, staleness, [], "cmd", "abc")
    assert out["decision_p99_ms"] == {"goodput": 0.104, "random": 0.002}
    assert out["decision_p99_ms_max_512"] == 0.104
    assert out["poller_staleness_p99_ms_512"] == 90.0  # at the default interval (50 ms)
    assert out["poller_staleness_p99_ms_512_by_interval_ms"] == {"100": 160.0, "50": 90.0}
    assert out["poller_staleness_p99_ms_512_emulator_by_interval_ms"] == {"100": 700.0}
    assert out["command"] == "cmd" and out["commit"] == "abc"


def test_latency_runs_cover_every_policy_that_needs_no_artifact() -> None:
    from bench.studies.policy_latency import without_params
    from policies import POLICIES

    names = without_params()
    assert {"round_robin", "goodput", "prefix_aware"} <= set(names)
    assert "eldr" in POLICIES and "eldr" not in names  # needs its trained centroids


def test_decisions_only_replaces_the_decision_figures_alone(tmp_path: object) -> None:
    import json
    from pathlib import Path

    from bench.studies.scale import main

    out = Path(str(tmp_path)) / "scale.json"
    out.write_text(json.dumps({"decision_p99_ms": {"goodput": 9.0}, "load": ["kept"],
                               "command": "old", "commit": "old"}))
    assert main(["--decisions-only", "--backends", "512", "--picks", "300",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["load"] == ["kept"] and report["command"] == "old"  # the rest stays
    assert report["decisions_command"].endswith("--out " + str(out))
    assert {"goodput", "round_robin"} <= set(report["decision_p99_ms"])
    assert report["decision_p99_ms"]["goodput"] != 9.0
    assert {r["backends"] for r in report["decisions"]} == {512}


def test_goodput_decisions_are_timed_with_slos() -> None:
    """policy_latency's requests carry SLOs, so goodput's timed picks run Algorithm 1
    (its reasons say so), not its no-SLO fallback."""
    import random

    from bench.studies.policy_latency import _contexts, _views
    from policies import build_policy
    from proxy.types import NO_PREDICTION

    rng = random.Random(0)
    contexts, views = _contexts(rng), _views(64, rng)
    assert 0.8 < sum(c.slo_ms is not None for c in contexts) / len(contexts) < 1.0
    goodput = build_policy("goodput", {})
    reasons = [goodput.pick(c, NO_PREDICTION, views[0]).reason for c in contexts[:200]]
    assert sum("just enough" in r or "least overrun" in r for r in reasons) > 150
