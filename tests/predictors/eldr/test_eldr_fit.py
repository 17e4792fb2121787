"""ELDR's balanced k-means and artifact."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from predictors.eldr.experts import normalize
from predictors.eldr.fit import balanced_kmeans, fit, load, read_calibration, save


def blobs(sizes: list[int], dims: int = 6, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(len(sizes)), sizes)
    centres = np.eye(dims)[: len(sizes)] * 5
    return normalize(centres[labels] + rng.random((len(labels), dims))), labels


def test_balanced_kmeans_recovers_equal_blobs() -> None:
    points, truth = blobs([20, 20, 20])
    _, labels = balanced_kmeans(points, 3)
    for cluster in range(3):  # each found cluster is exactly one true blob
        assert len(set(truth[labels == cluster])) == 1 and np.sum(labels == cluster) == 20


def test_no_cluster_takes_more_than_its_share_even_when_one_domain_dominates() -> None:
    points, _ = blobs([50, 5, 5])
    _, labels = balanced_kmeans(points, 3)
    assert np.bincount(labels).max() <= math.ceil(60 / 3)


def test_train_artifact_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    prefill = rng.poisson(2.0, (30, 2, 4))
    calibration = tmp_path / "calib.jsonl"
    calibration.write_text("".join(json.dumps({"prefill": p.tolist()}) + "\n" for p in prefill))
    counts, decode = read_calibration(calibration)
    assert decode is None and counts.shape == (30, 2, 4)
    model, report = fit(counts, decode, ["d0", "d1"])
    assert report["cluster_sizes"] == [15, 15] and report["layers"] == [0, 1]
    loaded = load(save(model, report, tmp_path / "art"))
    assert loaded.workers == ("d0", "d1")
    assert np.allclose(loaded.similarities(prefill[0]), model.similarities(prefill[0]))
    assert np.all(loaded.similarities(prefill[0]) <= 1.0 + 1e-9)


def test_laneway_train_eldr_writes_an_artifact_the_policy_loads(tmp_path: Path) -> None:
    from policies import build_policy
    from proxy.cli import main

    rng = np.random.default_rng(1)
    calibration = tmp_path / "records.jsonl"
    calibration.write_text("".join(
        json.dumps({"prefill": rng.poisson(2.0, (2, 4)).tolist(),
                    "decode": rng.poisson(1.0, (2, 4)).tolist()}) + "\n" for _ in range(12)))
    assert main(["train", "eldr", "--calibration", str(calibration), "--workers", "a,b,c",
                 "--out", str(tmp_path / "art")]) == 0
    assert load(tmp_path / "art").workers == ("a", "b", "c")
    assert build_policy("eldr", {"artifact": str(tmp_path / "art")}).name == "eldr"
