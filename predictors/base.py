"""The value predictors hand to policies, and the interface the proxy calls."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

if TYPE_CHECKING:
    from proxy.types import RequestContext


@dataclass(frozen=True, slots=True, eq=False)
class LengthPrior:
    """What a length predictor's arrival predictions are worth, from its artifact: the
    (predicted, true) output lengths of answers the predicting model was not trained
    on (`laneway train length --calibration-folds`: each training prompt predicted by a
    model fitted on the other folds). A policy that calibrates lengths
    (`predictors/calibration.py`) starts from these instead of from nothing. One object
    per predictor key, shared by every prediction of that key."""

    key: str
    samples: tuple[tuple[float, int], ...]


@dataclass(frozen=True, slots=True)
class Prediction:
    """A request's predicted cost. Empty when no predictor is configured.

    `output_tokens` is the predicted *total* output length, also mid-stream (tokens
    generated so far + tokens still to come), so a policy reads one meaning from
    every call: remaining = output_tokens - progress.generated.
    """

    output_tokens: float | None = None
    # the length predictor's out-of-fold (predicted, true) lengths, when its artifact has them
    length_prior: LengthPrior | None = None
    # ELDR: the request's expert signature (unit vector, predictors/experts.py), known
    # after a prefill leg on an MoE backend with the laneway_eldr plugin.
    expert_signature: tuple[float, ...] | None = None
    # qos_drl: per expert of the bucket predictor, the predicted generation score and
    # output length (bucket midpoints), computed off the event loop (proxy/stages.py);
    # () when the predictor failed or timed out.
    expert_scores: tuple[float, ...] | None = None
    expert_lengths: tuple[float, ...] | None = None


NO_PREDICTION = Prediction()

# How qos_drl's bucket predictor runs (predictors/buckets.py `load_artifact`); named
# here so the policy's params can say it without importing torch.
BucketRuntime = Literal["torch", "torch-int8", "onnx", "onnx-int8"]
BUCKET_RUNTIMES: tuple[BucketRuntime, ...] = get_args(BucketRuntime)
# what a bucket prediction reports as the value: the midpoint of the most likely bucket
# (the paper) or the probability-weighted mean of the midpoints (`BucketPredictor`)
BucketEstimate = Literal["midpoint", "expected"]
BUCKET_ESTIMATES: tuple[BucketEstimate, ...] = get_args(BucketEstimate)


def bucket_estimate(name: str) -> BucketEstimate:
    """`name` as a `BucketEstimate`; ValueError when it names none."""
    if name not in BUCKET_ESTIMATES:
        raise ValueError(f"bucket estimate {name!r}: one of {', '.join(BUCKET_ESTIMATES)}")
    return name


def checkpoint_estimate(meta: Mapping[str, Any], override: str | None = None
                        ) -> BucketEstimate:
    """The bucket estimate a qos_drl checkpoint (its `meta`) was trained on (`laneway
    train qos-drl --bucket-estimate`; midpoint before the option), unless `override`
    names one: what the policy and the benchmarks read the predictor with."""
    return bucket_estimate(override or meta.get("bucket_estimate") or "midpoint")


class Predictor(Protocol):
    """Turns a request into a `Prediction`; synchronous, no I/O, cheap (≤ 1 ms)."""

    def predict(self, ctx: RequestContext) -> Prediction:
        """At arrival, from the prompt alone."""
        ...

    def predict_window(self, ctx: RequestContext, generated_text: str,
                       generated_tokens: int) -> Prediction:
        """Mid-stream re-estimate (GoodServe: every τ tokens), from the answer so far."""
        ...


class NullPredictor:
    """No model configured: every request gets `NO_PREDICTION` (today's behaviour)."""

    def predict(self, ctx: RequestContext) -> Prediction:
        return NO_PREDICTION

    def predict_window(self, ctx: RequestContext, generated_text: str,
                       generated_tokens: int) -> Prediction:
        return NO_PREDICTION


LENGTH_ARTIFACT_FORMAT = 1  # meta.json "format" of `laneway train length`'s artifacts


class ArtifactError(ValueError):
    """A predictor artifact is missing, unreadable or of another kind or format."""


def check_length_artifact(path: str | Path) -> dict[str, Any]:
    """Its meta.json, or `ArtifactError` unless `path` holds a length_moe artifact of the
    format this version reads; reads meta.json only (no torch)."""
    meta_path = Path(path) / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except OSError as exc:
        raise ArtifactError(f"cannot read {meta_path}: {exc.strerror} (write the artifact "
                            "with `laneway train length`)") from None
    except ValueError:
        raise ArtifactError(f"{meta_path} is not JSON") from None
    if (not isinstance(meta, dict) or meta.get("kind") != "length_moe"
            or meta.get("format") != LENGTH_ARTIFACT_FORMAT):
        raise ArtifactError(f"{path}: not a length_moe artifact of format "
                            f"{LENGTH_ARTIFACT_FORMAT}")
    return meta


def require_artifact(path: Path, train_command: str) -> None:
    """For commands that read an artifact: exit with a message naming the command that
    writes one when `path` has none."""
    if not (path / "meta.json").is_file():
        raise SystemExit(f"no predictor artifact at {path} (no meta.json): write it with "
                         f"`{train_command}`")


def load_length_predictor(artifact: str | Path | None, model_map: Mapping[str, str],
                          fallback_key: str | None) -> Predictor:
    """The configured length predictor; torch is imported only when an artifact is set."""
    if artifact is None:
        return NullPredictor()
    from predictors.length import load_artifact

    return load_artifact(Path(artifact), model_map, fallback_key)
