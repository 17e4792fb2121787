"""bench_qos reports a bucket predictor's accuracy only for the artifact it ran."""

from __future__ import annotations

import json
from pathlib import Path

from bench.bench_qos import BUCKET_KEYS, bucket_accuracy, qos_rms, repo_path
from predictors.cli import REPO


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
