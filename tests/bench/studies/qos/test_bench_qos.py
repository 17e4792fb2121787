"""bench_qos reports a bucket predictor's accuracy only for the artifact it ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.studies.qos.bench_qos import BUCKET_KEYS, bucket_accuracy, qos_rms, repo_path
from predictors.home import REPO


def _files(tmp_path: Path, evaluated: str, used: str) -> tuple[Path, Path]:
    results = tmp_path / "bucket_predictor.json"
    results.write_text(json.dumps({"artifact_version": evaluated, "methods": {
        "minilm": dict.fromkeys(BUCKET_KEYS, 0.5)}}))
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / "meta.json").write_text(json.dumps({"version": used}))
    return results, artifact


def test_accuracy_of_the_artifact_evaluated(tmp_path: Path) -> None:
    results, artifact = _files(tmp_path, "v1", "v1")
    assert bucket_accuracy(results, artifact) == dict.fromkeys(BUCKET_KEYS, 0.5)


def test_no_accuracy_for_another_artifact_or_none_evaluated(tmp_path: Path) -> None:
    results, artifact = _files(tmp_path, "v1", "v2")
    assert bucket_accuracy(results, artifact) == {}
    assert bucket_accuracy(tmp_path / "missing.json", artifact) == {}


def test_qos_rms_over_the_live_cells() -> None:
    live = {"1": {"qos_drl": 0.4, "baseline_rl": 0.3}, "1.5": {"qos_drl": 0.2}}
    simulated = {"1": {"qos_drl": 0.5, "baseline_rl": 0.3, "round_robin": 0.9},
                 "1.5": {"qos_drl": 0.0}, "2": {"qos_drl": 0.7}}
    # errors 0.1, 0, -0.2 over the three live cells; cells the live run lacks don't count
    assert abs(qos_rms(simulated, live) - ((0.01 + 0.04) / 3) ** 0.5) < 1e-12
    assert qos_rms(live, live) == 0.0


def test_results_name_repository_paths_relatively(tmp_path: Path) -> None:
    assert repo_path(REPO / "docs" / "results" / "x.json") == "docs/results/x.json"
    assert repo_path(tmp_path / "x.json") == str(tmp_path / "x.json")


def test_fit_cores_simulates_the_live_runs_arrivals_rates_and_policies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each share is simulated with the live run's λs, policies and number of arrivals
    (200 live: a fresh 200-arrival run, not the bench's 600), and the best RMS wins."""
    import argparse

    import bench.studies.qos.bench_qos as bench_qos

    live = tmp_path / "live.json"
    live.write_text(json.dumps({"arrivals_per_run": 200, "policies": ["qos_drl"],
                                "avg_qos": {"1": {"qos_drl": 0.4}, "1.5": {"qos_drl": 0.2}}}))
    seen: list[tuple[float, list[float], int, object]] = []

    def simulate(args: argparse.Namespace, qos_meta: object, baseline_meta: object,
                 only: object = None) -> dict[str, object]:
        seen.append((args.cores, list(args.rates), args.arrivals, only))
        qos = 0.4 if args.cores == 1.35 else 0.0
        return {"table": {f"{r:g}": {"qos_drl": {"avg_qos": qos}} for r in args.rates}}

    monkeypatch.setattr(bench_qos, "run_simulator", simulate)
    args = argparse.Namespace(live=live, fit_cores=[1.0, 1.35], rates=[0.7], arrivals=600,
                              cores=None, checkpoint=tmp_path / "a.pt",
                              baseline_checkpoint=tmp_path / "b.pt")
    fitted = bench_qos.fit_cores(args, {}, {})
    assert seen == [(1.0, [1.0, 1.5], 200, ["qos_drl"]), (1.35, [1.0, 1.5], 200, ["qos_drl"])]
    assert fitted["arrivals_per_run"] == 200 and fitted["best_cores"] == 1.35
    assert abs(fitted["fits"]["1.35"]["rms"] - (0.2 ** 2 / 2) ** 0.5) < 1e-12
