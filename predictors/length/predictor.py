"""The trained length predictor as the proxy uses it, and its versioned artifact.

An artifact is a directory: `meta.json` (format, version, data digest, token unit,
training config, per-model scale and tier edges), `featurizer.json` (TF-IDF
vocabulary and idf; shared by all models so a request is encoded once) and
`weights.pt` (one `MoELength` state dict per predictor key, loaded with
`weights_only=True`), and, when trained with `--calibration-folds`, `calibration.json`
(per key, the out-of-fold (predicted, true) lengths of the training prompts: the
`LengthPrior` each prediction carries). Keys are expert model names plus "any"; the
proxy maps a request's model to a key with `predictors.length.model_map`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from predictors.base import LENGTH_ARTIFACT_FORMAT, check_length_artifact
from predictors.length.features import Featurizer
from predictors.length.moe import FusedMoE, MoEConfig, MoELength
from predictors.length.train import Trained
from proxy.types import NO_PREDICTION, LengthPrior, Prediction, RequestContext

CALIBRATION_FILE = "calibration.json"


@dataclass(frozen=True, slots=True)
class KeyModel:
    """One backend model's predictor, ready for single-request inference."""

    fused: FusedMoE
    scale: float


class LengthPredictor:
    """Predicted output tokens of a request, at arrival and again mid-stream."""

    def __init__(self, featurizer: Featurizer, models: Mapping[str, KeyModel],
                 model_map: Mapping[str, str], fallback_key: str | None,
                 priors: Mapping[str, LengthPrior] | None = None) -> None:
        self.featurizer = featurizer
        self.models = dict(models)
        self.model_map = dict(model_map)
        self.fallback_key = fallback_key
        self.priors = dict(priors or {})

    def predict(self, ctx: RequestContext) -> Prediction:
        return self.predict_window(ctx, "", 0)

    def predict_window(self, ctx: RequestContext, generated_text: str,
                       generated_tokens: int) -> Prediction:
        """Total output tokens (generated + still to come) given the answer so far."""
        key = self.key_for(ctx.model) or ""
        model = self.models.get(key)
        if model is None:
            return NO_PREDICTION
        indices, weights = self.featurizer.encode(ctx.prompt_text, generated_text,
                                                  generated_tokens)
        with torch.inference_mode():
            remaining = model.fused(torch.tensor(indices), torch.tensor(weights)) * model.scale
        total = generated_tokens + max(1.0, remaining)
        if ctx.max_tokens is not None:
            total = min(total, float(ctx.max_tokens))
        return Prediction(output_tokens=total, length_prior=self.priors.get(key))

    def key_for(self, model: str) -> str | None:
        return self.model_map.get(model, model if model in self.models else self.fallback_key)


def save_artifact(target: Path, featurizer: Featurizer, trained: Mapping[str, Trained],
                  meta: dict[str, Any], config: MoEConfig,
                  priors: Mapping[str, Sequence[tuple[float, int]]] | None = None) -> None:
    """Write the artifact directory (aside, then renamed: readers never see half of it);
    `priors`: per key, out-of-fold (predicted, true) lengths for `calibration.json`."""
    scratch = target.with_name(f"{target.name}.tmp")
    scratch.mkdir(parents=True, exist_ok=True)
    keys = {key: {"scale": t.scale, "input_edges": t.input_edges,
                  "output_edges": t.output_edges, "subset_rows": t.subset_sizes}
            for key, t in trained.items()}
    full = {"format": LENGTH_ARTIFACT_FORMAT, "kind": "length_moe", **meta,
            "config": asdict(config), "keys": keys}
    (scratch / "meta.json").write_text(json.dumps(full, indent=1))
    (scratch / "featurizer.json").write_text(json.dumps(featurizer.state()))
    torch.save({key: t.model.state_dict() for key, t in trained.items()}, scratch / "weights.pt")
    if priors:
        (scratch / CALIBRATION_FILE).write_text(json.dumps(
            {key: [[round(p, 2), a] for p, a in pairs] for key, pairs in priors.items()}))
    if target.exists():
        for old in target.iterdir():
            old.unlink()
        target.rmdir()
    scratch.rename(target)


def load_artifact(path: Path, model_map: Mapping[str, str] | None = None,
                  fallback_key: str | None = "any") -> LengthPredictor:
    """Load for inference: single-threaded torch, fused experts, no autograd."""
    torch.set_num_threads(1)  # one small request at a time; threads only add latency
    meta = check_length_artifact(path)
    featurizer = Featurizer.from_state(json.loads((path / "featurizer.json").read_text()))
    config = config_from(meta["config"])
    states = torch.load(path / "weights.pt", weights_only=True)
    models: dict[str, KeyModel] = {}
    for key, info in meta["keys"].items():
        model = MoELength(featurizer.dim, config)
        model.load_state_dict(states[key])
        models[key] = KeyModel(FusedMoE(model.eval()), float(info["scale"]))
    return LengthPredictor(featurizer, models, model_map or {}, fallback_key,
                           read_priors(path))


def read_priors(path: Path) -> dict[str, LengthPrior]:
    """The artifact's `calibration.json` as one `LengthPrior` per key ({} without one:
    an artifact trained without `--calibration-folds`)."""
    file = path / CALIBRATION_FILE
    if not file.is_file():
        return {}
    saved: dict[str, list[list[float]]] = json.loads(file.read_text())
    return {key: LengthPrior(key, tuple((float(p), int(a)) for p, a in pairs))
            for key, pairs in saved.items()}


def config_from(saved: dict[str, Any]) -> MoEConfig:
    return MoEConfig(**{**saved, "expert_hidden": tuple(saved["expert_hidden"])})
