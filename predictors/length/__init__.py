"""GoodServe's output-length predictor: a TF-IDF + MoE-MLP per expert model, its
training, evaluation, calibration prior and latency (docs: policies/goodput)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from predictors.base import NullPredictor, Predictor


def load_length_predictor(artifact: str | Path | None, model_map: Mapping[str, str],
                          fallback_key: str | None) -> Predictor:
    """The configured length predictor; torch is imported only when an artifact is set."""
    if artifact is None:
        return NullPredictor()
    from predictors.length.predictor import load_artifact

    return load_artifact(Path(artifact), model_map, fallback_key)
