import json
from pathlib import Path

from bench.studies.goodput import length_pooled
from bench.studies.goodput.length_pooled import KeyedFeaturizer, keyed
from predictors.length.data import load_samples
from predictors.length.features import Featurizer
from tests.predictors.helpers import MODELS, counter, write_data


def test_keyed_features_are_the_base_ones_plus_the_model_one_hot(tmp_path: Path) -> None:
    samples = load_samples(write_data(tmp_path / "d.jsonl"), counter())
    base = Featurizer.fit([s.prompt for s in samples])
    pooled = KeyedFeaturizer.of(base, tuple(MODELS))
    assert pooled.dim == base.dim + len(MODELS)
    for sample in samples[:4]:
        indices, weights = pooled.encode(keyed(sample).prompt, "some answer", 7)
        base_indices, base_weights = base.encode(sample.prompt, "some answer", 7)
        assert indices[:-1] == base_indices and weights[:-1] == base_weights
        assert (indices[-1], weights[-1]) == (base.dim + MODELS.index(sample.key), 1.0)


def test_one_run_scores_every_method_both_ways(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    write_data(tmp_path / "data" / "alpaca_eval_experts.jsonl", prompts=90)
    out = tmp_path / "pooled.json"
    assert length_pooled.main(["--shared", str(tmp_path), "--epochs", "30",
                               "--out", str(out)]) == 0
    table = json.loads(out.read_text())["table"]
    methods = ["mean", "median", "tfidf_ridge", "single_mlp", "moe"]
    assert set(table) == {f"{way}/{m}" for way in ("per_model", "pooled") for m in methods}
    assert all(row["n"] == 18 * len(MODELS) for row in table.values())  # ids % 5 == 0
    # The synthetic answers' length follows the prompt's words and the model: the pooled
    # MoE must learn both (the one-hot tells the models apart), the pooled mean cannot.
    assert table["pooled/moe"]["mae"] < 0.5 * table["pooled/mean"]["mae"]
