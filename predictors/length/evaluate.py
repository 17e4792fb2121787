"""Held-out evaluation of the length predictor against simple baselines.

The split is fixed (ids % 5 == 0 held out, `length_data.is_heldout`). Every method sees
the same training rows of the same model and predicts, from the prompt alone, the
held-out answers' lengths. Metrics: MAE in tokens; accuracy within ±25 % of the true
length; bucket accuracy over 10 equal-width buckets of [0, longest training answer]
(the bucketing of qos_drl_edge_routing.txt, so the bucket predictor can be compared).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from predictors.length.data import Row, Sample, arrival_rows
from predictors.length.features import Featurizer
from predictors.length.moe import FusedMoE, MoEConfig, SparseBatch, SparseMLP
from predictors.length.predictor import KeyModel
from predictors.length.train import encode, fit, targets, train_moe

BUCKETS = 10
Method = Callable[[Sequence[Row]], np.ndarray]  # held-out rows → predicted remaining tokens


@dataclass(frozen=True, slots=True)
class Score:
    key: str
    method: str
    mae: float
    within_25: float
    bucket_acc: float
    n: int


def score(key: str, method: str, predicted: np.ndarray, truth: np.ndarray,
          longest: float) -> Score:
    width = max(longest, 1.0) / BUCKETS
    bucket_hits = np.minimum(predicted // width, BUCKETS - 1) == np.minimum(
        truth // width, BUCKETS - 1)
    return Score(key, method, float(np.mean(np.abs(predicted - truth))),
                 float(np.mean(np.abs(predicted - truth) <= 0.25 * truth)),
                 float(np.mean(bucket_hits)), len(truth))


def baselines(train: Sequence[Row], featurizer: Featurizer,
              config: MoEConfig) -> dict[str, Method]:
    """Mean and median length, TF-IDF + ridge regression, one 4-layer MLP (STAR-like)."""
    lengths = np.array([r.sample.output_tokens for r in train if r.generated_tokens == 0])
    mean, median = float(lengths.mean()), float(np.median(lengths))
    return {
        "mean": lambda rows: np.full(len(rows), mean),
        "median": lambda rows: np.full(len(rows), median),
        "tfidf_ridge": ridge(train, featurizer),
        "single_mlp": single_mlp(train, featurizer, config, mean),
    }


def ridge(train: Sequence[Row], featurizer: Featurizer) -> Method:
    from sklearn.linear_model import Ridge

    arrival = [r for r in train if r.generated_tokens == 0]
    model = Ridge(alpha=1.0).fit(sparse_matrix(arrival, featurizer),
                                 [r.remaining for r in arrival])
    return lambda rows: np.maximum(1.0, model.predict(sparse_matrix(rows, featurizer)))


def sparse_matrix(rows: Sequence[Row], featurizer: Featurizer) -> object:
    from scipy.sparse import csr_matrix

    data = encode(rows, featurizer)
    return csr_matrix((data.weights.numpy(), data.indices.numpy(), data.indptr.numpy()),
                      shape=(len(rows), featurizer.dim))


def single_mlp(train: Sequence[Row], featurizer: Featurizer, config: MoEConfig,
               scale: float) -> Method:
    """One expert-shaped MLP on all training rows: what the MoE must beat (paper §3.2)."""
    torch.manual_seed(config.seed)
    net = SparseMLP(featurizer.dim, config.expert_hidden, 1)
    fit(net, encode(train, featurizer), targets(train, scale), config)

    def predict(rows: Sequence[Row]) -> np.ndarray:
        batch = SparseBatch.of([featurizer.encode(r.sample.prompt, r.generated_text,
                                                  r.generated_tokens) for r in rows])
        with torch.inference_mode():
            predicted: np.ndarray = np.maximum(1.0, net(batch).squeeze(1).numpy() * scale)
        return predicted

    return predict


def moe_method(model: KeyModel, featurizer: Featurizer) -> Method:
    """The artifact's predictor, one request at a time, exactly as the proxy runs it."""
    def predict(rows: Sequence[Row]) -> np.ndarray:
        out = []
        with torch.inference_mode():
            for r in rows:
                indices, weights = featurizer.encode(r.sample.prompt, r.generated_text,
                                                     r.generated_tokens)
                remaining = model.fused(torch.tensor(indices), torch.tensor(weights))
                out.append(max(1.0, remaining * model.scale))
        return np.array(out)

    return predict


def cross_fit(rows: Sequence[Row], featurizer: Featurizer, config: MoEConfig, folds: int
              ) -> list[tuple[float, int]]:
    """Out-of-fold arrival predictions, for the artifact's `LengthPrior`: the prompts
    cut into `folds` by id (a seeded permutation; every answer and window of a prompt
    in one fold), each fold's answers predicted by `moe_method` (as the proxy predicts)
    with a model trained (`train_moe`, the same config) on the other folds' rows.
    (predicted total, true length) per answer, in the rows' order."""
    if folds < 2:
        raise ValueError("cross-fitting needs at least 2 folds")
    ids = sorted({r.sample.id for r in rows})
    fold_of = {i: n % folds for n, i in enumerate(random.Random(config.seed).sample(ids, len(ids)))}
    arrivals = [r for r in rows if r.generated_tokens == 0]
    predicted: dict[int, float] = {}  # index in arrivals -> predicted total
    for fold in range(folds):
        trained = train_moe([r for r in rows if fold_of[r.sample.id] != fold], featurizer,
                            config)
        held = [n for n, r in enumerate(arrivals) if fold_of[r.sample.id] == fold]
        moe = moe_method(KeyModel(FusedMoE(trained.model), trained.scale), featurizer)
        predicted.update(zip(held, moe([arrivals[n] for n in held]), strict=True))
    return [(float(predicted[n]), r.sample.output_tokens) for n, r in enumerate(arrivals)]


def evaluate_key(key: str, train: Sequence[Row], test: Sequence[Sample],
                 methods: dict[str, Method]) -> list[Score]:
    rows = arrival_rows(test)
    truth = np.array([s.output_tokens for s in test], dtype=float)
    longest = float(max(r.sample.output_tokens for r in train))
    return [score(key, name, method(rows), truth, longest) for name, method in methods.items()]


def evaluate_windows(key: str, rows: Sequence[Row], moe: Method,
                     longest: float) -> list[Score]:
    """Mid-stream: tokens still to come, re-estimated vs arrival estimate - generated."""
    truth = np.array([r.remaining for r in rows], dtype=float)
    generated = np.array([r.generated_tokens for r in rows], dtype=float)
    arrival = moe(arrival_rows([r.sample for r in rows]))
    return [score(key, "moe_window", moe(rows), truth, longest),
            score(key, "arrival_minus_generated", np.maximum(1.0, arrival - generated),
                  truth, longest)]


def markdown(scores: Sequence[Score]) -> str:
    lines = ["| model key | predictor | MAE (tokens) | within ±25 % | bucket acc | n |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {s.key} | {s.method} | {s.mae:.1f} | {s.within_25:.1%} | "
              f"{s.bucket_acc:.1%} | {s.n} |" for s in scores]
    return "\n".join(lines)
