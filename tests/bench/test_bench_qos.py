"""bench_qos reports a bucket predictor's accuracy only for the artifact it ran."""

from __future__ import annotations

import json
from pathlib import Path

from bench.bench_qos import BUCKET_KEYS, bucket_accuracy


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
