"""bench.studies.qos.score_signal: the per-prompt headroom and the prompt's signal about it, and
the BERTScore-style F1 on the real MiniLM encoder."""

from __future__ import annotations

import numpy as np
import pytest

from bench.studies.qos.score_signal import bertscore_f1, knn_predict, sentence_embeddings, signal


def test_signal_finds_a_score_the_prompt_gives_away_and_the_per_prompt_headroom() -> None:
    rng = np.random.default_rng(0)
    topics = ["python code bug fix", "poem about the sea", "recipe for bread"]
    prompts = [f"{topics[i % 3]} number {i}" for i in range(300)]
    # expert a is good at code, expert b at everything else; c is mediocre everywhere
    scores = np.array([[0.9, 0.2, 0.5] if i % 3 == 0 else [0.2, 0.8, 0.5]
                       for i in range(300)]) + rng.normal(0, 0.02, (300, 3))
    heldout = np.array([i % 5 == 0 for i in range(300)])
    out = signal(scores, prompts, heldout, ["a", "b", "c"])
    assert out["best_expert"] == "b"
    truth = scores[heldout]
    assert out["per_prompt_best_mean"] == pytest.approx(truth.max(1).mean())
    assert out["per_prompt_gain"] > 0.1  # code prompts to a: well above always b
    ridge = out["predictors"]["tfidf_ridge"]
    assert ridge["spearman_within_prompt"] > 0.5  # the topic words rank the experts
    assert ridge["argmax_pick_mean"] == pytest.approx(out["per_prompt_best_mean"], abs=0.03)
    # a score the prompt says nothing about: no signal
    noise = rng.uniform(0, 1, (300, 3))
    blind = signal(noise, prompts, heldout, ["a", "b", "c"])
    assert abs(blind["predictors"]["tfidf_ridge"]["spearman_within_prompt"]) < 0.3


def test_embedding_predictors_on_the_real_encoder_tell_topics_apart() -> None:
    """minilm_ridge and minilm_knn on MiniLM's sentence embeddings: prompts about code
    and about the sea, with no word in common between training and held-out prompts of
    a topic, so only the encoder's sense of meaning can carry the topic across."""
    code = ["fix this python bug", "why does my java program crash", "sort a list in rust",
            "debug a segmentation fault in C", "write a unit test for a function",
            "explain a null pointer exception", "optimize a slow SQL query",
            "my typescript code will not compile"]
    sea = ["write a poem about ocean waves", "describe a storm at sea",
           "a haiku about the beach at dawn", "a song about sailors and the tide",
           "verses on whales in deep water", "a sonnet about a lighthouse",
           "describe seagulls over the harbor", "a ballad of a shipwreck"]
    prompts = code + sea
    scores = np.array([[0.9, 0.1]] * len(code) + [[0.1, 0.9]] * len(sea))
    heldout = np.array([i % 4 == 3 for i in range(len(prompts))])
    emb = sentence_embeddings(prompts)
    assert emb.shape == (16, 384)
    assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    out = signal(scores, prompts, heldout, ["coder", "poet"], emb, knn_k=3)
    for name in ("minilm_ridge", "minilm_knn"):
        assert out["predictors"][name]["argmax_pick_mean"] == pytest.approx(0.9), name


def test_knn_predict_averages_the_nearest_training_rows() -> None:
    train = np.array([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]])
    y = np.array([[1.0], [3.0], [10.0]])
    got = knn_predict(train, y, np.array([[1.0, 0.0]]), k=2)
    assert got.tolist() == [[2.0]]  # rows 0 and 1, not the orthogonal row 2


def test_bertscore_is_one_for_the_reference_itself_and_lower_for_another_answer() -> None:
    rows = [{"reference": "Paris is the capital of France.",
             "experts": {"same": {"output": "Paris is the capital of France."},
                         "other": {"output": "Bananas are rich in potassium."},
                         "empty": {"output": ""}}}]
    f1 = bertscore_f1(rows, ["same", "other", "empty"])
    assert f1[0, 0] == pytest.approx(1.0, abs=1e-4)
    assert 0.0 < f1[0, 1] < 0.9
    assert f1[0, 2] == 0.0
