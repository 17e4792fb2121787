"""bench/studies/goodput/breakdown.py: a kept goodput run broken down by GPU tier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench.harness.plots import inflight_series
from bench.harness.results import Migration, RequestResult, writing
from bench.harness.solo import SoloLatencies
from bench.studies.goodput import breakdown as goodput_breakdown
from bench.studies.goodput.breakdown import breakdown, peak_inflight, run_files

TIERS = {"h-0": "h100", "h-1": "h100", "t-0": "t4"}
SOLO = SoloLatencies({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0})


def _r(rid: str, backend: str, sent: float, e2e: float,
       moves: tuple[Migration, ...] = ()) -> RequestResult:
    return RequestResult(0, rid, "m", sent, sent, e2e, 0.1, 0.01, (0.1,), 10, 50, 50,
                         backend, 200, migrations=moves)


MOVE = Migration("t-0", "h-1", 20, "SLO risk", 0.5)
RUN = [_r("a", "t-0", 0.0, 3.0, (MOVE,)),  # on t-0 0-0.5, then on h-1 0.5-3
       _r("b", "t-0", 0.2, 1.5),  # t-0 0.2-1.7
       _r("c", "h-0", 0.0, 0.9),
       _r("d", "h-1", 0.4, 2.5)]  # h-1 0.4-2.9


def test_a_moved_request_counts_on_each_backend_for_its_own_leg() -> None:
    assert inflight_series(RUN[:1]) == {"t-0": [(0.0, 1), (0.5, 0)], "h-1": [(0.5, 1), (3.0, 0)]}
    assert inflight_series(RUN[1:2]) == {"t-0": [(0.2, 1), (1.7, 0)]}


def test_peak_in_flight_per_backend() -> None:
    # t-0: a (0-0.5) overlaps b (0.2-1.7): 2; h-1: d (0.4-2.9) and a (0.5-3): 2
    assert peak_inflight(RUN) == {"t-0": 2, "h-1": 2, "h-0": 1}
    # a request that ends as another starts on the same backend: never both at once
    back_to_back = [_r("a", "t-0", 0.0, 1.0), _r("b", "t-0", 1.0, 1.0)]
    assert peak_inflight(back_to_back) == {"t-0": 1}


def test_rows_by_first_placement_tier() -> None:
    rows = {row.tier: row for row in breakdown(RUN, TIERS, SOLO, scale=2.0)}
    t4, h100 = rows["t4"], rows["h100"]
    # a (3.0 s) misses 2 x 1.0, b (1.5 s) meets it; a moved, and ended on the H100 tier
    assert (t4.instances, t4.placed, t4.met, t4.moved, t4.ended_here) == (1, 2, 1, 1, 1)
    assert (h100.instances, h100.placed, h100.met, h100.moved, h100.ended_here) == \
        (2, 2, 1, 0, 3)
    assert (t4.moves_out, t4.moves_within, h100.moves_out) == (1, 0, 0)
    assert (h100.peak_inflight_mean, h100.peak_inflight_max) == (1.5, 2)


def test_length_ratio_of_met_and_missed_per_tier() -> None:
    ratios = {"a": 0.4, "b": 1.0, "c": 2.0, "d": 3.0}
    rows = {row.tier: row for row in breakdown(RUN, TIERS, SOLO, 2.0, lambda r: ratios[r.id])}
    # t4: b met (1.0), a missed (0.4); h100: c met (2.0), d missed (3.0 s > 2 x 1.0)
    assert (rows["t4"].met_length_ratio, rows["t4"].missed_length_ratio) == (1.0, 0.4)
    assert (rows["h100"].met_length_ratio, rows["h100"].missed_length_ratio) == (2.0, 3.0)
    plain = breakdown(RUN, TIERS, SOLO, 2.0)
    assert all(r.met_length_ratio is None and r.missed_length_ratio is None for r in plain)


def test_moves_between_instances_of_one_tier_are_counted_apart() -> None:
    there = Migration("h-0", "h-1", 50, "SLO risk", 0.4)
    back = Migration("h-1", "h-0", 100, "SLO risk", 0.8)
    up = Migration("t-0", "h-0", 50, "SLO risk", 0.4)
    run = [_r("a", "h-0", 0.0, 1.0, (there, back)), _r("b", "t-0", 0.0, 1.0, (up,))]
    rows = {row.tier: row for row in breakdown(run, TIERS, SOLO, scale=2.0)}
    assert (rows["h100"].moves_out, rows["h100"].moves_within) == (2, 2)
    assert (rows["t4"].moves_out, rows["t4"].moves_within) == (1, 0)


def test_a_failed_request_never_meets_its_slo() -> None:
    failed = [RequestResult(0, "a", "m", 0.0, 0.0, 0.5, None, None, (), None, None, 50,
                            "h-0", 502, "upstream")]
    rows = {row.tier: row for row in breakdown(failed, TIERS, SOLO, scale=3.0)}
    assert (rows["h100"].placed, rows["h100"].met) == (1, 0)


def _write(path: Path, label: str, rs: list[RequestResult]) -> None:
    with writing(path / f"{label}.jsonl") as w:
        w.header({"label": label, "policy": label.partition("@")[0]})
        for r in rs:
            w(r)
    backends = [{"name": n, "url": f"http://x/{n}", "model": "m", "labels": {"profile": t}}
                for n, t in TIERS.items()]
    (path / f"{label}.yaml").write_text(yaml.safe_dump({"backends": backends}))


def test_a_baseline_run_and_a_variants_run_at_the_scale(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    _write(tmp_path, "solo", [_r(k, "h-0", 0.0, 1.0) for k in "abcd"])
    _write(tmp_path, "least_request", RUN)
    _write(tmp_path, "goodput@2", RUN[:2])
    _write(tmp_path, "goodput@3", RUN[2:])
    assert set(run_files(tmp_path, 2.0)) == {"least_request", "goodput"}
    assert run_files(tmp_path, 2.0)["goodput"].name == "goodput@2.jsonl"
    out = tmp_path / "b.json"
    assert goodput_breakdown.main([str(tmp_path), "--scale", "2", "--out", str(out)]) == 0
    policies = json.loads(out.read_text())["policies"]
    assert sum(row["placed"] for row in policies["goodput"]) == 2
    row = "| least_request | t4 | 1 | 50% | 50% | 50% | 1 | 1 (0) | 2.0 / 2 |"
    assert row in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"goodput \(ran at 2, 3\)"):
        run_files(tmp_path, 1.5)  # the baselines serve every scale, the variant did not
    with pytest.raises(SystemExit):
        goodput_breakdown.main([str(tmp_path), "--scale", "1.5"])
    with pytest.raises(SystemExit):
        goodput_breakdown.main([str(tmp_path / "nowhere")])


def test_decisions_from_a_kept_proxy_log_by_reason_kind_and_tier() -> None:
    import dataclasses

    from bench.studies.goodput.breakdown import DecisionRow, decisions, reason_kind

    rs = [dataclasses.replace(r, seq=i) for i, r in enumerate(RUN)]  # a, d miss; b, c meet
    prefix = "2026-11-27 04:00:00,000 INFO proxy.routing.router: request"
    log = "\n".join([
        f"{prefix} bench-0-a model=m -> t-0 (just enough: T=1.000s <= D=2.000s with the "
        "slowest feasible d=40.0ms (2 feasible); 3 candidates)",
        f"{prefix} bench-1-b model=m -> t-0 (just enough (capability): T=1.0s <= D=2.0s "
        "(protect: 1 refused, e.g. h-0 for x); 3 candidates)",
        f"{prefix} bench-2-c model=m -> h-0 (none feasible: least overrun T=3.000s > "
        "D=2.000s (protect: all 3 would harm a request); 3 candidates)",
        f"{prefix} bench-3-d model=m -> h-1 (none feasible: least overrun T=3.0s > D=2.0s; "
        "3 candidates)",
        f"{prefix} bench-0-a: policy moves it t-0 -> h-1 after 20 tokens (SLO risk: finish "
        "3.00s > D 2.00s here; none feasible: least overrun T=2.5s > D=1.5s)",
        f"{prefix} bench-9-zz model=m -> h-0 (just enough: T=1s <= D=2s; 3 candidates)",
        "2026-11-27 04:00:00,000 INFO uvicorn: something else"])
    rows = decisions(log, rs, TIERS, SOLO, scale=2.0)
    assert rows == [
        DecisionRow("arrival", "every backend would be harmed", "", "h100", 1, 1),
        DecisionRow("arrival", "feasible", "", "t4", 1, 0),
        DecisionRow("arrival", "feasible after protect refused some", "", "t4", 1, 1),
        DecisionRow("arrival", "none feasible", "", "h100", 1, 0),  # d: 2.5 s > 2 s
        DecisionRow("move", "none feasible", "t4", "h100", 1, 0)]  # bench-9: no record
    assert reason_kind("no SLO: least in-flight (3)") == "no SLO"
    assert reason_kind("least in-flight 2") == "least in-flight N"
    assert reason_kind("prefix match 0 blocks, too short; least in-flight 33") == \
        "prefix match N blocks, too short"


def test_the_breakdown_reads_the_lines_the_router_logs(caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    """ARRIVAL and MOVE parse `proxy.routing.router.Router`'s own log lines (their format lives
    there): a goodput pick and a τ-check move, logged and read back."""
    import dataclasses
    import logging

    from bench.studies.goodput.breakdown import decisions
    from policies.goodput.policy import Goodput, GoodputParams
    from proxy.fleet.registry import Registry
    from proxy.observability.metrics import Metrics
    from proxy.routing.router import Router
    from proxy.types import BackendStats, Prediction, Progress
    from tests.policies.helpers import backends, ctx, view

    fleet = backends(3)
    stats = {f"b{i}": BackendStats(tpot_s=t, healthy=True, updated_at=1.0)
             for i, t in enumerate((0.010, 0.020, 0.040))}
    router = Router(Goodput(GoodputParams(handoff_s=0.0)), Metrics(Registry(fleet)),
                    log_decisions=True)
    request = dataclasses.replace(ctx("p" * 40, request_id="bench-0-a", max_tokens=400),
                                  slo_ms=10_000)
    with caplog.at_level(logging.INFO, logger="laneway.routing"):
        router.pick(request, Prediction(output_tokens=100), view(fleet, stats=stats))
        router.reroute(request, Prediction(output_tokens=400),
                       Progress(backend=fleet[2], generated=50, max_tokens=400, elapsed_s=2.0,
                                ttft_s=0.1, tpot_s=0.040, migrations=0),
                       view(fleet[:2], stats=stats))
    tiers = {"b0": "fast", "b1": "mid", "b2": "slow"}
    record = dataclasses.replace(RUN[2], id="a")  # seq 0, 0.9 s: meets 2 x 1.0 s
    rows = decisions(caplog.text, [record], tiers, SOLO, scale=2.0)
    assert [(r.event, r.kind, r.source, r.tier, r.count) for r in rows] == [
        ("arrival", "feasible", "", "slow", 1), ("move", "feasible", "slow", "mid", 1)]


def test_the_slo_base_judges_as_the_run_did(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`--slo-base median`: b (solo 0.5 s, 1.5 s end to end) misses its own 2 x 0.5 s
    but meets 2 x the median solo latency (1 s of 1, 0.5, 1, 1), as its run judged it."""
    _write(tmp_path, "solo", [_r(k, "h-0", 0.0, 0.5 if k == "b" else 1.0) for k in "abcd"])
    _write(tmp_path, "least_request", RUN)
    t4 = "| least_request | t4 | 1 | 50% | {} | 50% | 1 | 1 (0) | 2.0 / 2 |"
    assert goodput_breakdown.main([str(tmp_path), "--scale", "2"]) == 0
    assert t4.format("0%") in capsys.readouterr().out
    assert goodput_breakdown.main([str(tmp_path), "--scale", "2", "--slo-base", "median"]) == 0
    assert t4.format("50%") in capsys.readouterr().out
