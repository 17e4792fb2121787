"""Is the MoE length predictor short of data? One MoE over all six models' answers.

    python -m bench.studies.goodput.length_pooled [--shared datasets] [--out
    docs/results/length_pooled.json]

The per-model predictors (`laneway train length`) give each of the K = 9 phase-1 experts
~36 prompts of one model, and the held-out table has them behind a TF-IDF ridge
regression and a single MLP. This trains, in one run on the fixed split, the per-model
MoE of the artifact and one *pooled* MoE on every model's training answers with a
one-hot of the answering model appended to the features (the paper's two phases
unchanged: tiers over all models' lengths, so each expert sees ~6x the rows), and the
same baselines both ways, and scores each on every model's held-out answers.
Not a production option: an experiment (README, Predictors).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from bench.harness.report import git_commit
from bench.harness.results import write_json
from predictors.cli import training_rows
from predictors.home import DATASETS, REPO
from predictors.length.data import (
    ANY_KEY,
    Row,
    Sample,
    arrival_rows,
    is_heldout,
    load_samples,
    token_counter,
)
from predictors.length.evaluate import Method, Score, baselines, score
from predictors.length.features import Featurizer, SparseRow
from predictors.length.moe import MoEConfig, SparseBatch
from predictors.length.train import Trained, train_moe

KEY_MARK = "\x00"  # a pooled Sample's prompt is "<model>\x00<prompt>"
ROWS = {"tau": 50, "windows": 2, "seed": 0}  # `laneway train length`'s defaults


@dataclasses.dataclass(frozen=True, slots=True)
class KeyedFeaturizer(Featurizer):
    """The artifact's features plus a one-hot of the answering model, read from the
    model name that a pooled Sample carries in front of its prompt."""

    keys: tuple[str, ...] = ()

    @classmethod
    def of(cls, base: Featurizer, keys: tuple[str, ...]) -> KeyedFeaturizer:
        return cls(base.vocabulary, base.idf, base.analyzer, keys)

    @property
    def dim(self) -> int:
        return len(self.idf) + 2 + len(self.keys)

    def encode(self, prompt: str, generated_text: str, generated_tokens: int) -> SparseRow:
        key, _, real = prompt.partition(KEY_MARK)
        indices, weights = Featurizer.encode(self, real, generated_text, generated_tokens)
        return [*indices, len(self.idf) + 2 + self.keys.index(key)], [*weights, 1.0]


def keyed(sample: Sample) -> Sample:
    return dataclasses.replace(sample, prompt=f"{sample.key}{KEY_MARK}{sample.prompt}")


def moe_method(trained: Trained, featurizer: Featurizer) -> Method:
    def predict(rows: Sequence[Row]) -> np.ndarray:
        batch = SparseBatch.of([featurizer.encode(r.sample.prompt, r.generated_text,
                                                  r.generated_tokens) for r in rows])
        with torch.inference_mode():
            out: np.ndarray = trained.model(batch).reshape(-1).numpy()
        return np.maximum(1.0, out * trained.scale)

    return predict


def pooled_score(name: str, predicted: np.ndarray, test: Sequence[Sample],
                 longest: dict[str, float]) -> Score:
    """One method over every model's held-out answers (each model's own bucket width),
    as the README's per-model table pools them."""
    parts = [score(key, name, predicted[mine], np.array(
        [test[i].output_tokens for i in mine], dtype=float), longest[key])
        for key in longest for mine in [[i for i, s in enumerate(test) if s.key == key]]]
    n = sum(p.n for p in parts)
    def mean(field: str) -> float:
        return float(sum(getattr(p, field) * p.n for p in parts) / n)

    return Score("all", name, mean("mae"), mean("within_25"), mean("bucket_acc"), n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shared", type=Path, default=DATASETS)
    parser.add_argument("--out", type=Path, default=REPO / "docs/results/length_pooled.json")
    parser.add_argument("--epochs", type=int, default=500)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    counter = token_counter("auto")
    samples = load_samples(args.shared / "data/alpaca_eval_experts.jsonl", counter)
    keys = tuple(sorted({s.key for s in samples}))
    config = MoEConfig(epochs=args.epochs)
    featurizer = Featurizer.fit([f"{s.prompt}\n{s.output}" for s in samples
                                 if not is_heldout(s.id)])
    test = [s for s in samples if is_heldout(s.id)]
    longest = {k: float(max(s.output_tokens for s in samples
                            if s.key == k and not is_heldout(s.id))) for k in keys}
    predicted: dict[str, np.ndarray] = {}
    started = time.monotonic()
    for key in keys:  # per model, as `laneway train length` does
        rows = training_rows(samples, counter, key, ROWS)
        mine = [i for i, s in enumerate(test) if s.key == key]
        methods = {**baselines(rows, featurizer, config),
                   "moe": moe_method(train_moe(rows, featurizer, config), featurizer)}
        for name, method in methods.items():
            out = predicted.setdefault(f"per_model/{name}", np.zeros(len(test)))
            out[mine] = method(arrival_rows([test[i] for i in mine]))
        print(f"per model {key}: {time.monotonic() - started:.0f} s", flush=True)
    pooled_featurizer = KeyedFeaturizer.of(featurizer, keys)
    rows = training_rows([keyed(s) for s in samples], counter, ANY_KEY, ROWS)
    trained = train_moe(rows, pooled_featurizer, config)
    methods = {**baselines(rows, pooled_featurizer, config),
               "moe": moe_method(trained, pooled_featurizer)}
    keyed_test = arrival_rows([keyed(s) for s in test])
    for name, method in methods.items():
        predicted[f"pooled/{name}"] = method(keyed_test)
    print(f"pooled: {time.monotonic() - started:.0f} s, phase-1 rows per expert "
          f"{trained.subset_sizes}", flush=True)
    table = {name: dataclasses.asdict(pooled_score(name, p, test, longest))
             for name, p in predicted.items()}
    for name, row in table.items():
        print(f"{name:24s} MAE {row['mae']:6.1f}  within ±25 % {row['within_25']:.1%}  "
              f"bucket {row['bucket_acc']:.1%}")
    result = {"table": table, "unit": counter.unit.replace(f"{REPO}/", ""),
              "heldout": "id % 5 == 0", "epochs": args.epochs,
              "pooled_subset_sizes": trained.subset_sizes,
              "command": " ".join(["python -m bench.studies.goodput.length_pooled", *sys.argv[1:]]),
              "commit": git_commit()}
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
