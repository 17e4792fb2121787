"""ELDR's locality band over synthetic centroids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from policies import build_policy
from policies.eldr import Eldr, EldrParams
from predictors.eldr.experts import SignatureSpec, normalize
from predictors.eldr.fit import EldrModel, save
from proxy.types import NO_PREDICTION, Prediction
from tests.policies.helpers import backends, ctx, view

B = backends(3)
# Centroids in a 3-d signature space: b0 ~ x, b1 ~ mostly x, b2 ~ z.
CENTROIDS = normalize(np.array([[1.0, 0.0, 0.0], [0.95, 0.31, 0.0], [0.0, 0.0, 1.0]]))
SPEC = SignatureSpec(np.ones((1, 3)), (0,))


def policy(tau: float, workers: tuple[str, ...] = ("", "", "")) -> Eldr:
    return Eldr(EldrParams(artifact="-", tau=tau), EldrModel(SPEC, CENTROIDS, workers))


def signed(vector: list[float]) -> Prediction:
    return Prediction(expert_signature=tuple(normalize(np.array(vector))))


def test_band_takes_the_least_loaded_similar_worker() -> None:
    chosen = policy(0.1).pick(ctx(), signed([1, 0, 0]), view(B, {"b0": 5, "b1": 1}))
    assert chosen.backend.name == "b1"  # 0.95 is within 0.1 of b0's 1.0
    chosen = policy(0.1).pick(ctx(), signed([0, 0, 1]), view(B, {"b2": 9}))
    assert chosen.backend.name == "b2"  # alone in its band, however loaded


def test_tau_zero_is_pure_locality_and_a_wide_band_is_shortest_queue() -> None:
    loads = {"b0": 5, "b1": 1, "b2": 0}
    assert policy(0.0).pick(ctx(), signed([1, 0, 0]), view(B, loads)).backend.name == "b0"
    assert policy(2.0).pick(ctx(), signed([1, 0, 0]), view(B, loads)).backend.name == "b2"


def test_without_a_signature_it_balances_load() -> None:
    chosen = policy(0.1).pick(ctx(), NO_PREDICTION, view(B, {"b0": 2, "b1": 1, "b2": 3}))
    assert chosen.backend.name == "b1" and "no expert signature" in chosen.reason


def test_named_workers_own_their_centroids_and_others_are_ignored() -> None:
    eldr = policy(0.0, ("b2", "b0", "b1"))  # centroid 0 (x) belongs to b2
    assert eldr.pick(ctx(), signed([1, 0, 0]), view(B)).backend.name == "b2"
    assert eldr.pick(ctx(), signed([0, 0, 1]), view(B[:2])).backend.name == "b1"  # z


def test_build_policy_loads_the_trained_artifact(tmp_path: Path) -> None:
    save(EldrModel(SPEC, CENTROIDS, ("", "", "")), {}, tmp_path)
    eldr = build_policy("eldr", {"artifact": str(tmp_path)})
    assert eldr.pick(ctx(), signed([0, 0.1, 1]), view(B)).backend.name == "b2"
    with pytest.raises(ValueError, match="tau"):
        build_policy("eldr", {"artifact": str(tmp_path), "tau": -1})
