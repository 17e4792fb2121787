"""How much a router could gain from knowing each request's quality per expert, and how
much of it the prompt reveals (issue 8, diagnosis of the ≥ 30 % target).

For the two generation scores the issue allows: the judge's win rate against the
reference (`win_rate_vs_reference`, the one laneway uses) and a BERTScore-style F1
against the reference (greedy matching of all-MiniLM-L6-v2's contextual token
embeddings, as BERTScore does with its encoder; answers and reference cut to 256
tokens, no idf weighting, no baseline rescaling), on the project's held-out split
(`length_data.is_heldout`):

* per-expert means, and how far per-prompt choice could lift quality above always
  sending to the best expert (the per-prompt best answer's mean / the best expert's);
* predictors per expert trained on the other ids, each judged by the Spearman
  correlation of its predictions with the score (per expert), of its *within-prompt*
  deviations with the true ones (can it rank the experts for one prompt?), and the
  mean true score of the expert it would pick per prompt: a TF-IDF + ridge regression
  (`tfidf_ridge`), and on the pretrained encoder's own sentence embeddings (MiniLM's
  mean-pooled, normalized last layer, as all-MiniLM-L6-v2 is trained to be used, not
  fine-tuned here) a ridge regression with its penalty chosen by cross-validation on
  the training ids (`minilm_ridge`) and the mean score of the k most similar training
  prompts (`minilm_knn`, k = 25, cosine).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from predictors.home import ALPACA_EVAL, REPO, laneway_home, open_text
from predictors.length.data import is_heldout

RESULTS = REPO / "docs" / "results"
MAX_TOKENS = 256
KNN_K = 25


def pretrained_encoder() -> tuple[Any, Any]:
    """all-MiniLM-L6-v2's tokenizer and model as pretrained (the bucket predictor's base
    encoder, not fine-tuned), on one torch thread."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from predictors.buckets.predictor import base_encoder_dir

    torch.set_num_threads(1)
    encoder = base_encoder_dir()
    return AutoTokenizer.from_pretrained(encoder), AutoModel.from_pretrained(encoder).eval()


def bertscore_f1(rows: list[dict[str, Any]], experts: list[str]) -> NDArray[np.float64]:
    """(prompt, expert) -> F1 of the expert's answer against the reference."""
    import torch

    tokenizer, model = pretrained_encoder()

    def tokens(text: str) -> torch.Tensor:
        batch = tokenizer(text, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state[0, 1:-1]  # without [CLS], [SEP]
        return torch.nn.functional.normalize(hidden, dim=-1)

    out = np.zeros((len(rows), len(experts)))
    for i, row in enumerate(rows):
        reference = tokens(row["reference"])
        for j, name in enumerate(experts):
            answer = tokens(row["experts"][name]["output"] or " ")
            if len(answer) == 0 or len(reference) == 0:
                continue  # an empty answer scores 0
            sim = answer @ reference.T
            precision = sim.max(1).values.mean().item()
            recall = sim.max(0).values.mean().item()
            out[i, j] = 2 * precision * recall / (precision + recall)
    return out


def sentence_embeddings(prompts: list[str]) -> NDArray[np.float64]:
    """MiniLM's sentence embedding per prompt: the mean of the last layer over the
    tokens, normalized (all-MiniLM-L6-v2's pooling), prompts cut to 256 tokens."""
    import torch

    tokenizer, model = pretrained_encoder()
    out: list[NDArray[np.float64]] = []
    for i in range(0, len(prompts), 32):
        batch = tokenizer(prompts[i:i + 32], truncation=True, max_length=MAX_TOKENS,
                          padding=True, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        out.append(torch.nn.functional.normalize(pooled, dim=-1).double().numpy())
    return np.concatenate(out)


def knn_predict(train_x: NDArray[np.float64], train_y: NDArray[np.float64],
                test_x: NDArray[np.float64], k: int = KNN_K) -> NDArray[np.float64]:
    """Per test row and expert, the mean score of its k most cosine-similar training
    rows (rows normalized)."""
    nearest = np.argsort(-(test_x @ train_x.T), axis=1)[:, :k]
    return np.asarray(train_y[nearest].mean(1))


def judge(pred: NDArray[np.float64], truth: NDArray[np.float64]) -> dict[str, float]:
    """How well held-out predictions (prompt, expert) follow the true scores."""
    from scipy.stats import spearmanr

    deviation_true = truth - truth.mean(1, keepdims=True)
    deviation_pred = pred - pred.mean(1, keepdims=True)
    rows = np.arange(len(truth))
    experts = range(truth.shape[1])
    return {
        "spearman_per_expert": float(np.mean(
            [spearmanr(pred[:, j], truth[:, j]).correlation for j in experts])),
        "spearman_within_prompt": float(np.mean(
            [spearmanr(deviation_pred[:, j], deviation_true[:, j]).correlation
             for j in experts])),
        "argmax_pick_mean": float(truth[rows, pred.argmax(1)].mean()),
    }


def signal(scores: NDArray[np.float64], prompts: list[str], heldout: NDArray[np.bool_],
           experts: list[str], embeddings: NDArray[np.float64] | None = None,
           knn_k: int = KNN_K) -> dict[str, Any]:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import Ridge, RidgeCV

    train = ~heldout
    vectorizer = TfidfVectorizer(sublinear_tf=True, min_df=2, ngram_range=(1, 2))
    vectorizer.fit([p for p, t in zip(prompts, train, strict=True) if t])
    x = vectorizer.transform(prompts)
    truth = scores[heldout]
    predictions = {"tfidf_ridge": np.column_stack([
        Ridge(alpha=3.0).fit(x[train], scores[train, j]).predict(x[heldout])
        for j in range(len(experts))])}
    if embeddings is not None:
        alphas = np.logspace(-2, 3, 11)
        predictions["minilm_ridge"] = np.column_stack([
            RidgeCV(alphas=alphas).fit(embeddings[train], scores[train, j])
            .predict(embeddings[heldout]) for j in range(len(experts))])
        predictions["minilm_knn"] = knn_predict(embeddings[train], scores[train],
                                                embeddings[heldout], knn_k)
    means = truth.mean(0)
    return {
        "mean_per_expert": dict(zip(experts, means.round(4).tolist(), strict=True)),
        "best_expert": experts[int(means.argmax())], "best_expert_mean": float(means.max()),
        "per_prompt_best_mean": float(truth.max(1).mean()),
        "per_prompt_gain": float(truth.max(1).mean() / means.max() - 1),
        "within_prompt_std": float(truth.std(1).mean()),
        "predictors": {name: judge(pred, truth) for name, pred in predictions.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=ALPACA_EVAL)
    parser.add_argument("--cache", type=Path,
                        default=laneway_home() / "cache" / "bertscore_minilm.npy",
                        help="the BERTScore matrix (~10 min on one core to compute)")
    parser.add_argument("--out", type=Path, default=RESULTS / "qos_score_signal.json")
    args = parser.parse_args(argv)
    with open_text(args.data) as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    experts = list(rows[0]["experts"])
    if args.cache.exists():
        f1 = np.load(args.cache)
    else:
        f1 = bertscore_f1(rows, experts)
        args.cache.parent.mkdir(parents=True, exist_ok=True)
        np.save(args.cache, f1)
    win = np.array([[r["experts"][n]["win_rate_vs_reference"] for n in experts] for r in rows])
    heldout = np.array([is_heldout(r["id"]) for r in rows])
    prompts = [r["instruction"] for r in rows]
    embeddings = sentence_embeddings(prompts)
    result = {"heldout_prompts": int(heldout.sum()),
              "win_rate": signal(win, prompts, heldout, experts, embeddings),
              "bertscore_minilm": signal(f1, prompts, heldout, experts, embeddings),
              "correlation_win_rate_bertscore": dict(zip(experts, [
                  round(float(np.corrcoef(win[:, j], f1[:, j])[0, 1]), 3)
                  for j in range(len(experts))], strict=True))}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
