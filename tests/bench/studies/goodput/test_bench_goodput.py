"""bench/studies/goodput/bench_goodput.py: goodput per scale and the ratio to the best baseline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.harness import compare
from bench.harness.report import SloPoint, Summary
from bench.studies.goodput import bench_goodput
from bench.studies.goodput.bench_goodput import per_scale, ratios, table, variants

SCALES = [1.0, 2.0]


def _summary(name: str, goodput: dict[float, float], migrations: int = 0,
             attainment: float = 0.5) -> Summary:
    slo = tuple(SloPoint(s, attainment, g) for s, g in goodput.items())
    return Summary(name, name, 10, 0, migrations, 10.0, 1.0, 1.0, 100.0, None, None,
                   (1.0, 2.0, 3.0), 10, slo, None, 0)


def test_a_baseline_run_serves_every_scale() -> None:
    assert per_scale("rr", [_summary("rr", {1.0: 0.2, 2.0: 0.5})], SCALES) == {
        "1": 0.2, "2": 0.5}


def test_a_per_scale_policy_counts_each_run_at_its_own_scale() -> None:
    runs = [_summary("g@1", {1.0: 0.4, 2.0: 0.1}), _summary("g@2", {1.0: 0.1, 2.0: 0.9})]
    assert per_scale("g", runs, SCALES) == {"1": 0.4, "2": 0.9}
    met = [_summary("g@1", {1.0: 0.4}, attainment=0.3), _summary("g@2", {2.0: 0.9}, attainment=0.8)]
    assert per_scale("g", met, SCALES, compare.attainment_at) == {"1": 0.3, "2": 0.8}
    with pytest.raises(ValueError):
        per_scale("g", runs[:1] * 3, SCALES)


def test_ratio_against_the_best_baseline_at_each_scale() -> None:
    goodput = {"rr": {"1": 0.2, "2": 0.6}, "lr": {"1": 0.3, "2": 0.55},
               "goodput": {"1": 0.6, "2": 0.6}}
    out = ratios(goodput, ["rr", "lr"], "goodput", SCALES)
    assert out["goodput_ratio_vs_best_baseline"] == {"1": 2.0, "2": 1.0, "mean": 1.5}
    assert out["best_baseline_per_scale"] == {"1": "lr", "2": "rr"}
    assert out["best_baseline"] == "lr"  # mean 0.425 vs 0.4
    assert set(out) == {"goodput_ratio_vs_best_baseline", "best_baseline",
                        "best_baseline_per_scale"}
    none_met = {"rr": {"1": 0.0, "2": 0.5}, "lr": {"1": 0.0, "2": 0.25},
                "goodput": {"1": 0.1, "2": 1.0}}
    assert ratios(none_met, ["rr", "lr"], "goodput", SCALES)[
        "goodput_ratio_vs_best_baseline"] == {"1": None, "2": 2.0, "mean": 2.0}


def test_variants_cover_the_issue() -> None:
    by_label = {v.label: v for v in variants(with_predictor=True)}
    assert {"random", "round_robin", "least_request", "lowest_tpm", "prefix_aware"} <= set(
        by_label)
    assert by_label["goodput-no-migration"].params == {"migrate": False}
    assert by_label["goodput-oracle"].params == {"length_source": "hint"}
    assert not by_label["goodput-oracle"].predictor and by_label["goodput"].predictor
    assert all(v.per_scale == v.label.startswith("goodput") for v in by_label.values())


def test_table_has_one_row_per_policy() -> None:
    summaries = {"rr": [_summary("rr", {1.0: 0.2, 2.0: 0.5}, migrations=0)]}
    text = table({"rr": {"1": 0.2, "2": 0.5}}, summaries, SCALES)
    assert text.splitlines()[2] == "| rr | 0.20 | 0.50 | 3.00 | 0 | 0 |"


def test_a_run_of_one_fleet_keeps_the_other_fleets_figures(tmp_path: Path) -> None:
    path = tmp_path / "goodput.json"
    path.write_text(json.dumps({"fleets": [{"fleet": "emulated-64", "v": 1},
                                           {"fleet": "real-a", "v": 1}]}))
    merged = bench_goodput.merged_fleets(path, [{"fleet": "real-a", "v": 2},
                                                {"fleet": "real-b", "v": 2}])
    assert merged == [{"fleet": "emulated-64", "v": 1}, {"fleet": "real-a", "v": 2},
                      {"fleet": "real-b", "v": 2}]
    assert bench_goodput.merged_fleets(tmp_path / "none.json", merged) == merged


def _fleet(name: str, **extra: object) -> dict[str, object]:
    algorithm1 = {"goodput_ratio_vs_best_baseline": {"1": 1.1}, "best_baseline": "rr"}
    calibrated = {"goodput_ratio_vs_best_baseline": {"1": 1.6}, "best_baseline": "rr",
                  "goodput_ratio_range": {"1": [1.5, 1.7]}, "params": {"selection": "capability"}}
    return {"fleet": name, **algorithm1, "command": f"cmd {name}", "commit": "c",
            "variants": {"goodput": algorithm1, "goodput-calibrated": calibrated},
            "attainment_ratio_vs_best_baseline": {"goodput-calibrated": {"1": 1.2}},
            **extra}


def test_the_headline_is_algorithm_1_on_the_first_fleet_unless_a_run_named_one(
        tmp_path: Path) -> None:
    first, real = _fleet("emulated-64"), _fleet("real-median-slo")
    plain = bench_goodput.headline([first, real])
    assert (plain["primary_fleet"], plain["headline_variant"]) == ("emulated-64", "goodput")
    assert plain["goodput_ratio_vs_best_baseline"] == {"1": 1.1}
    assert "algorithm1_ratio_vs_best_baseline" not in plain

    named = bench_goodput.headline([first, {**real, "headline": "goodput-calibrated"}])
    assert named["primary_fleet"] == "real-median-slo"
    assert named["goodput_ratio_vs_best_baseline"] == {"1": 1.6}
    assert named["algorithm1_ratio_vs_best_baseline"] == {"1": 1.1}  # beside it, same runs
    assert named["headline_params"] == {"selection": "capability"}
    assert named["goodput_ratio_range"] == {"1": [1.5, 1.7]}
    assert named["attainment_ratio_vs_best_baseline"] == {"1": 1.2}
    assert named["command"] == "cmd real-median-slo"

    # a later --headline run takes the mark from the older entry; a plain run keeps it
    path = tmp_path / "goodput.json"
    path.write_text(json.dumps({"fleets": [first, {**real, "headline": "goodput"}]}))
    fresh = _fleet("emulated-64-median-slo", headline="goodput-calibrated")
    merged = bench_goodput.merged_fleets(path, [fresh])
    assert [f.get("headline") for f in merged] == [None, None, "goodput-calibrated"]
    kept = bench_goodput.merged_fleets(path, [_fleet("emulated-64")])
    assert [f.get("headline") for f in kept] == [None, "goodput"]


def test_a_headline_must_be_a_variant_the_run_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_goodput.main(["--no-predictor", "--only", "goodput-oracle", "--headline",
                            "goodput-capability", "--out", str(tmp_path / "g.json")])
    assert "--headline" in capsys.readouterr().err
    assert not (tmp_path / "g.json").exists()


def test_a_real_fleet_gets_a_lighter_default_workload() -> None:
    real = bench_goodput.default_workload("real:small,large", "/s")
    emulated = bench_goodput.default_workload("emulated:64", "/s")
    rate = real.index("--rate") + 1
    assert float(real[rate]) < float(emulated[rate]) and real[-1] == "/s"


def test_an_emulated_fleet_gets_load_in_proportion_to_its_size() -> None:
    def args(spec: str) -> dict[str, str]:
        given = bench_goodput.default_workload(spec, "/s")
        return dict(zip(given[::2], given[1::2], strict=True))

    small, large = args("emulated:64"), args("emulated:512")
    assert (small["--rate"], small["--requests"], small["--max-output"]) == ("16", "240", "512")
    assert (large["--rate"], large["--requests"], large["--max-output"]) == ("128", "1920", "256")


def test_a_dilated_fleet_gets_the_same_work_k_times_sparser() -> None:
    def args(spec: str, k: float) -> dict[str, str]:
        given = bench_goodput.default_workload(spec, "/s", k)
        return dict(zip(given[::2], given[1::2], strict=True))

    plain, slow = args("emulated:512", 1), args("emulated:512", 8)
    assert (slow["--rate"], slow["--requests"], slow["--max-output"]) == ("16", "1920", "256")
    assert plain["--requests"] == slow["--requests"]
    assert args("emulated:4@mooncake", 4)["--time-scale"] == "2"
    # @heavy: 8 req/s per backend for 15 s, as docs/results/goodput_heavy4 was run
    heavy = args("emulated:4@heavy", 3)
    assert (heavy["--workload"], heavy["--rate"], heavy["--requests"],
            heavy["--max-output"]) == ("poisson", "10.6667", "480", "512")
    for wrong in ("real:small,large@heavy", "emulated:4@nope"):
        with pytest.raises(SystemExit, match="unknown workload tag"):
            bench_goodput.default_workload(wrong, "/s")


def test_dilation_stretches_goodputs_clocks_and_leaves_the_baselines() -> None:
    chosen = bench_goodput.dilated_variants(variants(with_predictor=True), 8)
    by_label = {v.label: v for v in chosen}
    assert by_label["round_robin"].params == {}
    headroom = by_label["goodput-headroom"].params
    assert headroom["headroom"] == 0.25 and headroom["handoff_s"] == pytest.approx(0.4)
    assert headroom["default_tpot_s"] == pytest.approx(0.24)
    assert by_label["goodput-no-migration"].params["migrate"] is False
    assert bench_goodput.dilated_variants(chosen, 1) == chosen


def test_dilation_reaches_the_proxy_config() -> None:
    from bench.emulator.profile import dilated_fields
    from bench.harness.compare import MIGRATION_CLOCKS, Fleet, proxy_config
    from bench.harness.compare import Variant as V
    from proxy.config import MigrationConfig

    fleet = Fleet([], ["u"], ["u"], {"interval_s": 0.8},
                  dilated_fields(MigrationConfig(), MIGRATION_CLOCKS, 8))
    config = proxy_config(fleet, V("rr", "round_robin"), None, "e")
    assert config["poller"]["interval_s"] == pytest.approx(0.8)
    assert config["migration"]["pace_timeout_s"] == pytest.approx(24)
    assert "migration" not in proxy_config(Fleet([], ["u"], ["u"]), V("rr", "round_robin"),
                                           None, "e")


def test_the_mooncake_tag_replays_the_trace_with_longer_answers(tmp_path: Path) -> None:
    from bench.__main__ import main
    from bench.harness.workloads import load
    from predictors.home import DATASETS

    args = bench_goodput.default_workload("real:small,large@mooncake", str(DATASETS))
    out = tmp_path / "w.jsonl"
    assert main(["workload", *args, "--out", str(out)]) == 0
    workload = load(out)
    assert workload.meta["kind"] == "trace" and len(workload.requests) == 120
    outputs = [r.max_tokens for r in workload.requests]
    # scaled by 2 (not by the prompts' ~28): answers long enough for decode to matter
    assert 100 < sum(outputs) / len(outputs) and max(outputs) <= 256
    with pytest.raises(SystemExit, match="unknown workload tag"):
        bench_goodput.default_workload("real:small@nope", "/s")


def test_repeats_take_the_median_cells_and_each_repeats_own_ratio() -> None:
    runs = [{"rr": {"1": 0.2, "2": 0.6}, "goodput": {"1": 0.6, "2": 0.6}},
            {"rr": {"1": 0.4, "2": 0.3}, "goodput": {"1": 0.4, "2": 0.9}},
            {"rr": {"1": 0.0, "2": 0.5}, "goodput": {"1": 0.1, "2": 0.5}}]
    assert bench_goodput.median_cells(runs) == {"rr": {"1": 0.2, "2": 0.5},
                                                   "goodput": {"1": 0.4, "2": 0.6}}
    out = bench_goodput.repeated_ratios(runs, ["rr"], "goodput", SCALES)
    # per repeat: 3.0/1.0, 1.0/3.0, None/1.0 (no baseline met an SLO at scale 1)
    assert out["goodput_ratio_per_repeat"] == [{"1": 3.0, "2": 1.0, "mean": 2.0},
                                               {"1": 1.0, "2": 3.0, "mean": 2.0},
                                               {"1": None, "2": 1.0, "mean": 1.0}]
    assert out["goodput_ratio_vs_best_baseline"] == {"1": 2.0, "2": 1.0, "mean": 2.0}
    assert out["goodput_ratio_range"] == {"1": [1.0, 3.0], "2": [1.0, 3.0], "mean": [1.0, 2.0]}
    assert bench_goodput.repeated_ratios(runs[:1], ["rr"], "goodput", SCALES) == ratios(
        runs[0], ["rr"], "goodput", SCALES)


def test_odd_repeats_run_the_variants_in_reverse(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.harness import compare
    from bench.harness.compare import Plan, Variant

    plan = Plan([], [Variant("rr", "round_robin"), Variant("goodput", "goodput", {}, True)],
                SCALES, tmp_path / "out", 1, 1.0, None, slo_base="median")
    orders: list[list[str]] = []
    repeat = iter(range(10))
    bases: list[str] = []

    def run_all(p: Plan, fleet: object, work: Path) -> dict[str, list[Path]]:
        orders.append([v.label for v in p.variants])
        return {v.label: [work / v.label] for v in p.variants}

    def summaries(files: dict[str, list[Path]], solo: Path, scales: list[float],
                  slo_base: str) -> dict[str, list[Summary]]:
        bases.append(slo_base)  # every repeat judged on the plan's SLO base
        r = next(repeat)
        return {"rr": [_summary("rr", {1.0: 0.2 + r / 10, 2.0: 0.5})],
                "goodput": [_summary("g@1", {1.0: 0.4, 2.0: 0.0}),
                            _summary("g@2", {1.0: 0.0, 2.0: 0.5 + r / 10}, attainment=0.9)]}

    monkeypatch.setattr(compare, "run_all", run_all)
    monkeypatch.setattr(compare, "summaries", summaries)
    monkeypatch.setattr(compare, "report", lambda *a: None)
    out = bench_goodput.evaluate("f", object(), plan, tmp_path / "work", repeats=3)  # type: ignore[arg-type]
    assert orders == [["rr", "goodput"], ["goodput", "rr"], ["rr", "goodput"]]
    assert bases == ["median"] * 3 and out["slo_base"] == "median"
    assert out["repeats"] == 3 and len(out["goodput_rps_per_repeat"]) == 3
    assert out["goodput_rps"] == {"rr": {"1": 0.3, "2": 0.5}, "goodput": {"1": 0.4, "2": 0.6}}
    # ratios 2.0, 4/3, 4/3... at scale 1: 0.4/0.2, 0.4/0.3, 0.4/0.4 → median 4/3
    assert out["goodput_ratio_vs_best_baseline"]["1"] == pytest.approx(1.333)
    assert out["goodput_ratio_range"]["2"] == [1.0, 1.4]
    text = (tmp_path / "out" / "f" / "table.md").read_text()
    assert text.startswith("Goodput and attainment: median of 3")
    # attainment beside goodput: each per-scale run at its own scale
    assert out["slo_attainment"] == {"rr": {"1": 0.5, "2": 0.5}, "goodput": {"1": 0.5, "2": 0.9}}
    assert "| goodput | 50.0% | 90.0% |" in text
    assert out["attainment_ratio_vs_best_baseline"] == {
        "goodput": {"1": 1.0, "2": 1.8, "mean": 1.4}}


def test_kept_runs_log_every_decision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With --keep (Plan.decision_logs) each run's proxy logs its decisions to <run>.log
    beside its records; without, the proxy config and the command stay as they were."""
    import yaml

    from bench.harness.compare import Fleet, Plan, Variant, run_all

    commands: list[tuple[str, ...]] = []
    monkeypatch.setattr(compare, "cli", lambda *args: commands.append(args))
    fleet = Fleet([{"name": "b", "url": "http://x", "model": "m"}], ["http://x"], ["http://x"])
    for keep in (True, False):
        work = tmp_path / str(keep)
        work.mkdir()
        plan = Plan([], [Variant("goodput", "goodput", {}, True)], [1.0], tmp_path, 1, 1.0,
                    None, decision_logs=keep)
        run_all(plan, fleet, work)
        config = yaml.safe_load((work / "goodput@1.yaml").read_text())
        assert config.get("debug") == ({"log_decisions": True} if keep else None)
        run = commands[-1]
        assert (run[-2:] == ("--proxy-log", str(work / "goodput@1.log"))) == keep
        assert ("--proxy-log" in run) == keep


def test_slo_base_is_a_mid_tier_backend_as_in_the_paper(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """GoodServe's SLOs are solo latencies on a mid-tier GPU (an A800 among faster and
    slower): `bench solo` targets the A100 of h100/a100/l40s/t4 unless told otherwise."""
    from bench.harness import compare
    from bench.harness.compare import Fleet, Plan

    assert [compare.mid_index(n) for n in (1, 2, 3, 4, 5)] == [0, 0, 1, 1, 2]
    urls = [f"u{i}" for i in range(10)]  # four profiles cycled: u1, u5, u9 are A100s
    assert compare.instances_of(urls, 4, 1) == ["u1", "u5", "u9"]
    assert compare.instances_of(urls, 4, 0) == ["u0", "u4", "u8"]
    assert compare.GPU_PROFILES[compare.mid_index(len(compare.GPU_PROFILES))] == "a100-40gb"
    fleet = Fleet([], ["http://fast"], ["http://mid-0", "http://mid-1"])
    targets: list[list[str]] = []

    def cli(*args: str) -> None:  # every instance of the tier measures, one at a time each
        targets.append([args[i + 1] for i, arg in enumerate(args) if arg == "--target"])

    monkeypatch.setattr(compare, "cli", cli)
    for tier in ("mid", "fastest"):
        plan = Plan([], [], SCALES, tmp_path, 1, 1.0, None, solo_tier=tier)  # type: ignore[arg-type]
        compare.run_all(plan, fleet, tmp_path)
    assert targets == [["http://mid-0", "http://mid-1"], ["http://fast"]]
    with pytest.raises(SystemExit):  # only the two tiers
        bench_goodput.main(["--solo-tier", "slowest"])


def test_only_keeps_the_baselines_goodput_and_the_named_variants() -> None:
    from bench.studies.goodput.bench_goodput import BASELINES, select_variants, variants

    every = variants(True)
    assert [v.label for v in select_variants(every, None)] == [
        v.label for v in every if v.label not in (
            "goodput-risk-estimate", "goodput-load", "goodput-protect",
            "goodput-capability-headroom-protect", "goodput-quantile",
            "goodput-quantile-checks", "goodput-quantile-prior",
            "goodput-quantile-checks-prior", "goodput-capability-quantile-checks-prior",
            "goodput-capability-quantile-checks-prior-no-migration",
            "goodput-capability-headroom-quantile-checks-prior",
            "goodput-quantile-checks-protect",
            "goodput-quantile-checks-protect-fallback",
            "goodput-quantile-checks-protect-rescue",
            "goodput-capability-quantile-checks-protect-rescue",
            "goodput-least-loaded", "goodput-quantile-checks-protect-rescue-least-loaded",
            "goodput-quantile-checks-protect-rescue-load",
            "goodput-quantile-checks-protect-rescue-load-least-loaded",
            "goodput-quantile-checks-protect-rescue-load-stay",
            "goodput-capability-quantile-checks-protect-rescue-stay")
    ]  # those on request only
    assert select_variants(every, "goodput-risk-estimate")[-1].params == {
        "risk_speed": "estimate"}
    assert select_variants(every, "goodput-load")[-1].params == {"speed_at_load": True}
    assert select_variants(every, "goodput-quantile")[-1].params == {
        "length_quantile": 0.8, "calibration_min_samples": 20, "calibration_prior": False}
    assert select_variants(every, "goodput-quantile-checks-prior")[-1].params == {
        "length_quantile": 0.8, "calibration_min_samples": 20, "calibration_prior": True,
        "calibrate_checks": True}
    assert select_variants(every, "goodput-capability-quantile-checks-prior-no-migration")[
        -1].params == {"length_quantile": 0.8, "calibration_min_samples": 20,
                       "calibration_prior": True, "calibrate_checks": True,
                       "selection": "capability", "migrate": False}
    assert select_variants(every, "goodput-capability-quantile-checks-protect-rescue")[
        -1].params == {"length_quantile": 0.8, "calibration_min_samples": 20,
                       "calibration_prior": False, "calibrate_checks": True, "protect": True,
                       "rescue_only": True,
                       "selection": "capability"}
    assert select_variants(every, "goodput-least-loaded")[-1].params == {
        "infeasible": "least_loaded"}
    assert select_variants(every, "goodput-quantile-checks-protect-rescue-load-least-loaded")[
        -1].params == {"length_quantile": 0.8, "calibration_min_samples": 20,
                       "calibration_prior": False, "calibrate_checks": True, "protect": True,
                       "rescue_only": True,
                       "speed_at_load": True, "infeasible": "least_loaded"}
    assert select_variants(every, "goodput-quantile-checks-protect-rescue-load-stay")[
        -1].params == {"length_quantile": 0.8, "calibration_min_samples": 20,
                       "calibration_prior": False, "calibrate_checks": True, "protect": True,
                       "rescue_only": True,
                       "speed_at_load": True, "harmful_moves": False}
    assert select_variants(every, "goodput-capability-quantile-checks-protect-rescue-stay")[
        -1].params == {"length_quantile": 0.8, "calibration_min_samples": 20,
                       "calibration_prior": False, "calibrate_checks": True, "protect": True,
                       "rescue_only": True,
                       "selection": "capability", "harmful_moves": False}
    chosen = [v.label for v in select_variants(every, "goodput-headroom")]
    assert chosen == [*BASELINES, "goodput", "goodput-headroom"]  # goodput: the headline
    with pytest.raises(SystemExit, match="unknown variants nope"):
        select_variants(every, "goodput,nope")


def test_a_missing_length_predictor_is_an_error_not_a_silent_constant(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LANEWAY_HOME", str(tmp_path))  # no predictors/length-moe-v1 here
    with pytest.raises(SystemExit):
        bench_goodput.main(["--out", str(tmp_path / "goodput.json")])
    assert "make train-length" in capsys.readouterr().err
    assert not (tmp_path / "goodput.json").exists()


def test_keep_leaves_the_runs_files_per_fleet(tmp_path: Path) -> None:
    with bench_goodput.work_dir(str(tmp_path / "kept"), "emulated-8") as work:
        (work / "solo.jsonl").write_text("{}\n")
    assert (tmp_path / "kept/emulated-8/solo.jsonl").exists()
    with bench_goodput.work_dir(None, "emulated-8") as work:
        temporary = work
        (work / "solo.jsonl").write_text("{}\n")
    assert not temporary.exists()


def test_side_figures_only_refreshes_the_three_figures_and_keeps_the_rest(
        tmp_path: Path) -> None:
    from bench.studies.goodput.bench_goodput import main, side_figures

    out = tmp_path / "goodput.json"
    out.write_text(json.dumps({"fleets": ["kept"], "decision_p99_ms_512": -1.0}))
    assert main(["--side-figures-only", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["fleets"] == ["kept"]
    assert {k: written[k] for k in side_figures()} == side_figures()
    assert written["decision_p99_ms_512"] != -1.0


def test_a_peer_router_runs_once_in_front_of_the_whole_fleet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--peers vllm-router:cache_aware`: a baseline run through vLLM Router (policy its
    own) in front of every backend, the harness pointed at the router."""
    import contextlib
    from collections.abc import Iterator

    from bench.harness.compare import Fleet, Plan

    started: list[tuple[tuple[str, ...], str]] = []
    runs: list[tuple[str, ...]] = []

    @contextlib.contextmanager
    def router(*workers: str, policy: str = "round_robin") -> Iterator[tuple[str, int]]:
        started.append((workers, policy))
        yield "http://router", 1

    monkeypatch.setattr(compare, "vllm_router", router)
    monkeypatch.setattr(compare, "cli", lambda *args: runs.append(args))
    chosen = bench_goodput.peer_variants("vllm-router:cache_aware",
                                         argparse.ArgumentParser())
    fleet = Fleet([{"name": "a", "url": "http://a"}, {"name": "b", "url": "http://b"}],
                  ["http://a"], ["http://b"])
    plan = Plan([], chosen, list(bench_goodput.SCALES), tmp_path, 1, 1.0, None)
    files = compare.run_all(plan, fleet, tmp_path)
    assert started == [(("http://a", "http://b"), "cache_aware")]
    run = runs[-1]
    assert run[0] == "run" and run[run.index("--target") + 1] == "http://router"
    assert run[run.index("--label") + 1] == "vllm-router-cache_aware"
    assert files == {"vllm-router-cache_aware": [tmp_path / "vllm-router-cache_aware.jsonl"]}
    assert not chosen[0].per_scale  # one run serves every scale, as a baseline's
    with pytest.raises(SystemExit):
        bench_goodput.peer_variants("envoy:least_request", argparse.ArgumentParser())
