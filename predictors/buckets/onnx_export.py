"""The bucket model on ONNX Runtime: `load_artifact(path, runtime="onnx-int8")`.

On first load the artifact's `BucketModel` is exported to ONNX (encoder with eager
attention, which ORT's BERT optimizer can fuse into Attention / SkipLayerNorm /
BiasGelu ops; the SDPA graph does not fuse), optimized, and for `onnx-int8`
quantized dynamically (QInt8 weights per output channel; activations quantized per
batch). The file is cached in `<artifact>/onnx/`, named by a digest of the artifact's
model files, the recipe and the onnxruntime version, so a retrained artifact or a
new recipe never runs a stale graph; older files of the same variant are removed.

Why: on this AVX2 CPU the fused int8 graph takes 6-8 ms per median prompt on one
thread against PyTorch int8's 9-13 ms, and it agrees with the float model far more
often (`laneway evaluate buckets --runtime onnx-int8`).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RECIPE = 1  # bump when the export / optimization / quantization steps change
MODEL_FILES = ("meta.json", "heads.pt")  # + everything under encoder/

# (artifact, attn_implementation=...) -> the float PyTorch model to export
TorchLoader = Callable[..., Any]


def artifact_digest(artifact: Path) -> str:
    """sha256 over the artifact's model files, the recipe and the onnxruntime version."""
    import onnxruntime

    digest = hashlib.sha256(f"recipe {RECIPE} ort {onnxruntime.__version__}\n".encode())
    files = [artifact / name for name in MODEL_FILES]
    files += sorted(p for p in (artifact / "encoder").rglob("*") if p.is_file())
    for path in files:
        digest.update(f"{path.relative_to(artifact)}\n".encode())
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def cached_model(artifact: Path, int8: bool, load_model: TorchLoader) -> Path:
    """The ONNX file for the artifact as it is now; built (seconds) when missing."""
    variant = "int8" if int8 else "float"
    cache = artifact / "onnx"
    path = cache / f"bucket-{variant}-{artifact_digest(artifact)}.onnx"
    if not path.exists():
        cache.mkdir(exist_ok=True)
        build(artifact, path, int8, load_model)
        for stale in cache.glob(f"bucket-{variant}-*.onnx"):
            if stale != path:
                stale.unlink(missing_ok=True)
    return path


def build(artifact: Path, out: Path, int8: bool, load_model: TorchLoader) -> None:
    """Export, fuse, optionally quantize; written atomically (replicas may race).
    `load_model`: the artifact's PyTorch model (predictors/buckets/predictor.py)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.transformers.optimizer import optimize_model

    model = load_model(artifact, attn_implementation="eager").eval()
    config = model.encoder.config
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        written = Path(tmp) / "exported.onnx"
        export(model, written)
        fused = optimize_model(str(written), model_type="bert", opt_level=0,
                               num_heads=int(config.num_attention_heads),
                               hidden_size=int(config.hidden_size))
        written = Path(tmp) / "fused.onnx"
        fused.save_model_to_file(str(written))
        if int8:
            quantized = Path(tmp) / "int8.onnx"
            # the fused ops are outside onnx's shape inference: say their outputs are float
            quantize_dynamic(written, quantized, weight_type=QuantType.QInt8,
                             per_channel=True,
                             extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
            written = quantized
        os.replace(written, out)


def export(model: Any, out: Path) -> None:
    """The model as ONNX: inputs input_ids, attention_mask [batch, seq]; outputs score,
    length [batch, n_experts, N_BUCKETS]."""
    ids = torch.ones((2, 8), dtype=torch.long)
    with warnings.catch_warnings():  # tracer notes on shape-derived Python values
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (ids, torch.ones_like(ids)), str(out), dynamo=False,
                          input_names=["input_ids", "attention_mask"],
                          output_names=["score", "length"], opset_version=17,
                          dynamic_axes={"input_ids": {0: "batch", 1: "seq"},
                                        "attention_mask": {0: "batch", 1: "seq"},
                                        "score": {0: "batch"}, "length": {0: "batch"}})


class OnnxBucketModel:
    """`BucketModel`'s call on an ORT session: torch tensors in and out, on `threads`
    intra-op threads. Those do not spin between runs: the stage runs one prompt at a
    time, and a spinning pool would take the core the proxy's event loop needs (on one
    prompt they are ~10 % faster than non-spinning ones)."""

    def __init__(self, path: Path, threads: int = 1) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.path = path
        self.session = onnxruntime.InferenceSession(str(path), options,
                                                    providers=["CPUExecutionProvider"])

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        score, length = self.session.run(None, {"input_ids": input_ids.numpy(),
                                                "attention_mask": attention_mask.numpy()})
        return torch.from_numpy(score), torch.from_numpy(length)


def load_onnx(artifact: Path, int8: bool, load_model: TorchLoader, threads: int = 1
              ) -> OnnxBucketModel:
    return OnnxBucketModel(cached_model(artifact, int8, load_model), threads)
