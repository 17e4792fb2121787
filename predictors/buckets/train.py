"""Fine-tuning and held-out evaluation of the bucket predictors (predictors/buckets/predictor.py).

Training: cross-entropy on both heads (score + length), AdamW, a few epochs; the
encoder is fine-tuned end to end. Evaluation: top-1/top-3 bucket accuracy over every
(held-out prompt, expert) pair, for the encoder and for a TF-IDF + logistic
regression baseline (one classifier per expert and head), and CPU latency.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from predictors.buckets.data import N_BUCKETS, PromptRow
from predictors.buckets.predictor import BucketModel, BucketPredictor, encode


@dataclass(frozen=True, slots=True)
class TrainConfig:
    epochs: int = 3
    batch_size: int = 16
    lr: float = 5e-5
    head_lr: float = 1e-3
    max_len: int = 128
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Distill:
    """Knowledge distillation (Hinton et al. 2015, as DistilBERT): the loss is
    (1 - alpha) · cross-entropy on the labels + alpha · T² · KL(teacher ‖ student) on both
    heads' logits softened by temperature T."""

    teacher: BucketModel
    temperature: float = 2.0
    alpha: float = 0.5


def soft_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float
              ) -> torch.Tensor:
    """T² · KL(softmax(teacher / T) ‖ softmax(student / T)), mean over rows."""
    flat_s = student.reshape(-1, student.shape[-1]) / temperature
    flat_t = teacher.reshape(-1, teacher.shape[-1]) / temperature
    return nn.functional.kl_div(flat_s.log_softmax(-1), flat_t.log_softmax(-1),
                                reduction="batchmean", log_target=True) * temperature ** 2


def train_model(model: BucketModel, tokenizer: object, rows: Sequence[PromptRow],
                score_labels: list[list[int]], length_labels: list[list[int]],
                config: TrainConfig, log: Callable[[str], None] = print,
                distill: Distill | None = None) -> list[float]:
    """Fine-tune in place (from `distill.teacher`'s outputs too, if given); returns the
    mean loss of every epoch."""
    torch.manual_seed(config.seed)
    heads = [*model.score_head.parameters(), *model.length_head.parameters()]
    optimizer = torch.optim.AdamW([
        {"params": model.encoder.parameters(), "lr": config.lr},
        {"params": heads, "lr": config.head_lr}], weight_decay=0.01)
    loss_fn = nn.CrossEntropyLoss()
    order = list(range(len(rows)))
    rng = random.Random(config.seed)
    losses = []
    model.train()
    for epoch in range(config.epochs):
        rng.shuffle(order)
        total, started = 0.0, time.monotonic()
        for start in range(0, len(order), config.batch_size):
            idx = order[start:start + config.batch_size]
            batch = encode(tokenizer, [rows[i].prompt for i in idx], model.n_experts,
                           config.max_len)
            score, length = model(batch["input_ids"], batch["attention_mask"])
            loss = (loss_fn(score.reshape(-1, N_BUCKETS),
                            torch.tensor([score_labels[i] for i in idx]).reshape(-1))
                    + loss_fn(length.reshape(-1, N_BUCKETS),
                              torch.tensor([length_labels[i] for i in idx]).reshape(-1)))
            if distill is not None:
                with torch.no_grad():
                    t_score, t_length = distill.teacher(batch["input_ids"],
                                                        batch["attention_mask"])
                soft = (soft_loss(score, t_score, distill.temperature)
                        + soft_loss(length, t_length, distill.temperature))
                loss = (1 - distill.alpha) * loss + distill.alpha * soft
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
        losses.append(total / len(rows))
        log(f"epoch {epoch + 1}/{config.epochs}: loss {losses[-1]:.3f} "
            f"({time.monotonic() - started:.0f} s)")
    model.eval()
    return losses


def topk_accuracy(logits: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Fraction of rows whose label is among the k largest logits (any trailing shape)."""
    flat = logits.reshape(-1, logits.shape[-1])
    top = np.argsort(-flat, axis=1)[:, :k]
    return float((top == labels.reshape(-1, 1)).any(axis=1).mean())


def encoder_scores(predictor: BucketPredictor, rows: Sequence[PromptRow],
                   score_labels: list[list[int]], length_labels: list[list[int]],
                   batch_size: int = 32) -> dict[str, float]:
    parts = [predictor.logits([r.prompt for r in rows[i:i + batch_size]])
             for i in range(0, len(rows), batch_size)]
    score = torch.cat([p[0] for p in parts]).numpy()
    length = torch.cat([p[1] for p in parts]).numpy()
    return _scores(score, length, score_labels, length_labels)


def tfidf_scores(train: Sequence[PromptRow], test: Sequence[PromptRow],
                 train_labels: tuple[list[list[int]], list[list[int]]],
                 test_labels: tuple[list[list[int]], list[list[int]]]) -> dict[str, float]:
    """TF-IDF (1-2 grams) + one logistic regression per expert and head."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
    x_train = vectorizer.fit_transform([r.prompt for r in train])
    x_test = vectorizer.transform([r.prompt for r in test])
    n_experts = len(train[0].scores)
    out = []
    for labels in train_labels:
        probs = np.full((len(test), n_experts, N_BUCKETS), -1.0)
        for e in range(n_experts):
            y = np.array([row[e] for row in labels])
            clf = LogisticRegression(max_iter=2000, C=1.0).fit(x_train, y)
            probs[:, e, clf.classes_] = clf.predict_proba(x_test)
        out.append(probs)
    return _scores(out[0], out[1], *test_labels)


def majority_scores(train_labels: tuple[list[list[int]], list[list[int]]],
                    test_labels: tuple[list[list[int]], list[list[int]]]) -> dict[str, float]:
    """Per expert and head, the training split's bucket frequencies as the prediction."""
    out = []
    for train, test in zip(train_labels, test_labels, strict=True):
        counts = np.zeros((len(train[0]), N_BUCKETS))
        for row in train:
            counts[np.arange(len(row)), row] += 1
        out.append(np.broadcast_to(counts, (len(test), *counts.shape)))
    return _scores(out[0], out[1], *test_labels)


def _scores(score: np.ndarray, length: np.ndarray, score_labels: list[list[int]],
            length_labels: list[list[int]]) -> dict[str, float]:
    s_lab, l_lab = np.array(score_labels), np.array(length_labels)
    return {"top1_score": topk_accuracy(score, s_lab, 1),
            "top3_score": topk_accuracy(score, s_lab, 3),
            "top1_length": topk_accuracy(length, l_lab, 1),
            "top3_length": topk_accuracy(length, l_lab, 3)}


def latency(predictor: BucketPredictor, prompts: Sequence[str], batch_sizes: Sequence[int],
            repeats: int = 3) -> dict[str, float]:
    """Per-request CPU latency: p50/p99 of single requests (every prompt, as
    bench/studies/qos/latency.py times the decision: the first 100 held-out prompts are shorter,
    their p50 ~15 % lower); per-request share of a batch of concurrent arrivals (batch
    time / batch size) for each batch size."""
    predictor.predict_batch(prompts[:4])  # warm-up
    single = []
    for prompt in prompts:
        started = time.perf_counter()
        predictor.predict_batch([prompt])
        single.append((time.perf_counter() - started) * 1000)
    out = {"single_p50_ms": statistics.median(single),
           "single_p99_ms": float(np.percentile(single, 99))}
    for size in batch_sizes:
        shares = []
        for _ in range(repeats):
            for start in range(0, min(len(prompts), 96) - size + 1, size):
                started = time.perf_counter()
                predictor.predict_batch(list(prompts[start:start + size]))
                shares.append((time.perf_counter() - started) * 1000 / size)
        out[f"batch{size}_per_request_p50_ms"] = statistics.median(shares)
    return out
