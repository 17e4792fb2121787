"""The interface the proxy calls on a predictor, and the artifacts predictors load.

What a predictor returns, `Prediction`, is part of the request vocabulary
(proxy/types.py): policies read it without importing any predictor."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

from proxy.types import NO_PREDICTION, Prediction

if TYPE_CHECKING:
    from proxy.types import RequestContext



# How qos_drl's bucket predictor runs (predictors/buckets/predictor.py `load_artifact`); named
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
