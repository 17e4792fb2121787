"""ELDR's offline fit: signatures of a calibration set -> one centroid per decoder.

Hungarian-balanced k-means (paper: "Offline: Balanced K-means"): every iteration
assigns points to centroids by a min-cost matching in which each centroid offers
ceil(N/K) slots (SciPy's `linear_sum_assignment` on cosine distances), so no cluster
-- no decode worker -- takes more than its share of the calibration workload.
The artifact (`eldr.json`) holds the signature spec and the centroids; the proxy's
`eldr` policy loads it. Re-running the fit on fresh records is the drift refit.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from predictors.eldr.experts import SignatureSpec, fit_signature, normalize

ARTIFACT = "eldr.json"


@dataclass(frozen=True, slots=True)
class EldrModel:
    spec: SignatureSpec
    centroids: np.ndarray  # [workers, dims], unit rows
    workers: tuple[str, ...]  # backend name per centroid ("" = by sorted name)

    def similarities(self, counts: np.ndarray) -> np.ndarray:
        """Cosine similarity of a request's counts [layers, experts] to each centroid."""
        out: np.ndarray = self.centroids @ self.spec.embed(counts)
        return out


def balanced_kmeans(points: np.ndarray, k: int, iterations: int = 30, seed: int = 0
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(centroids [k, d], labels [n]) with at most ceil(n/k) points per cluster."""
    from scipy.optimize import linear_sum_assignment

    rng = np.random.default_rng(seed)
    capacity = math.ceil(len(points) / k)
    centroids = _plus_plus(points, k, rng)
    labels = np.full(len(points), -1)
    for _ in range(iterations):
        cost = 1.0 - points @ centroids.T  # cosine distance, [n, k]
        rows, slots = linear_sum_assignment(np.repeat(cost, capacity, axis=1))
        new_labels = np.empty(len(points), int)
        new_labels[rows] = slots // capacity
        if np.array_equal(new_labels, labels):
            break
        labels = new_labels
        for cluster in range(k):
            members = points[labels == cluster]
            if len(members):
                centroids[cluster] = normalize(members.mean(axis=0))
    return centroids, labels


def _plus_plus(points: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    chosen = [int(rng.integers(len(points)))]
    for _ in range(1, k):
        distance = np.clip(1.0 - points @ points[chosen].T, 0, None).min(axis=1)
        total = distance.sum()
        weights = distance / total if total > 0 else None
        chosen.append(int(rng.choice(len(points), p=weights)))
    out: np.ndarray = points[chosen].copy()
    return out


def fit(prefill: np.ndarray, decode: np.ndarray | None, workers: int | list[str],
        seed: int = 0) -> tuple[EldrModel, dict[str, Any]]:
    started = time.perf_counter()
    spec, curve = fit_signature(prefill, decode)
    names = list(workers) if isinstance(workers, list) else [""] * workers
    centroids, labels = balanced_kmeans(spec.embed(prefill), len(names), seed=seed)
    report = {"fit_seconds": time.perf_counter() - started, "n": len(prefill),
              "k": len(names), "layers": list(spec.layers), "greedy_curve": curve,
              "cluster_sizes": np.bincount(labels, minlength=len(names)).tolist()}
    return EldrModel(spec, centroids, tuple(names)), report


def save(model: EldrModel, report: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    body = {"weights": model.spec.weights.tolist(), "layers": list(model.spec.layers),
            "centroids": model.centroids.tolist(), "workers": list(model.workers),
            "report": report}
    (out / ARTIFACT).write_text(json.dumps(body))
    return out / ARTIFACT


def load(path: Path) -> EldrModel:
    body = json.loads((path / ARTIFACT if path.is_dir() else path).read_text())
    spec = SignatureSpec(np.array(body["weights"]), tuple(body["layers"]))
    return EldrModel(spec, np.array(body["centroids"]), tuple(body["workers"]))


def read_calibration(path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    """JSONL of the plugin's records: `prefill` counts, and `decode` counts if known."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prefill = np.array([r["prefill"] for r in records], float)
    if all(np.sum(r.get("decode") or 0) > 0 for r in records):
        return prefill, np.array([r["decode"] for r in records], float)
    return prefill, None
