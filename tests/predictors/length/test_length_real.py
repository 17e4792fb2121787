"""The predictor on the real alpaca_eval data: it must beat the mean on the fixed split."""

import json
from pathlib import Path

import numpy as np

from predictors.home import ALPACA_EVAL, open_text
from predictors.length.data import arrival_rows, is_heldout, load_samples, samples_for
from predictors.length.evaluate import cross_fit, moe_method
from predictors.length.features import Featurizer
from predictors.length.moe import FusedMoE, MoEConfig
from predictors.length.predictor import KeyModel
from predictors.length.train import train_moe
from tests.predictors.helpers import counter

DATA = ALPACA_EVAL
KEY = "gpt-3.5-turbo-1106"  # the shortest answers: the cheapest model to train


def test_heldout_split_of_the_real_data_is_fixed() -> None:
    ids = [json.loads(line)["id"] for line in open_text(DATA)]
    held = [i for i in ids if is_heldout(i)]
    assert len(ids) == 805 and len(held) == 161 and held[:3] == [0, 5, 10]


def test_moe_beats_the_mean_on_heldout_mae(tmp_path: Path) -> None:
    # Word counts (not the tiny BPE) so the test does not depend on a built model;
    # fewer epochs than `laneway train length` keep it under a minute.
    samples = samples_for(load_samples(DATA, counter()), KEY)
    train = [s for s in samples if not is_heldout(s.id)]
    test = [s for s in samples if is_heldout(s.id)]
    featurizer = Featurizer.fit([f"{s.prompt}\n{s.output}" for s in train])
    trained = train_moe(arrival_rows(train), featurizer, MoEConfig(epochs=100))
    moe = moe_method(KeyModel(FusedMoE(trained.model), trained.scale), featurizer)
    truth = np.array([s.output_tokens for s in test], dtype=float)
    mean = np.mean([s.output_tokens for s in train])
    moe_mae = float(np.mean(np.abs(moe(arrival_rows(test)) - truth)))
    mean_mae = float(np.mean(np.abs(mean - truth)))
    assert moe_mae < 0.97 * mean_mae, (moe_mae, mean_mae)


def test_cross_fitted_predictions_are_out_of_fold() -> None:
    """The prior's predictions come from models that never saw the answer: on the
    training prompts they miss by more than the full model's own predictions of them
    (which it was fitted to), one (predicted, true) per training answer."""
    samples = samples_for(load_samples(DATA, counter()), KEY)
    train = [s for s in samples if not is_heldout(s.id)]
    rows = arrival_rows(train)
    featurizer = Featurizer.fit([f"{s.prompt}\n{s.output}" for s in train])
    config = MoEConfig(epochs=60)
    pairs = cross_fit(rows, featurizer, config, folds=2)
    assert [true for _, true in pairs] == [s.output_tokens for s in train]
    trained = train_moe(rows, featurizer, config)
    fitted = moe_method(KeyModel(FusedMoE(trained.model), trained.scale), featurizer)(rows)
    truth = np.array([s.output_tokens for s in train], dtype=float)
    out_of_fold = float(np.mean(np.abs(np.array([p for p, _ in pairs]) - truth)))
    in_sample = float(np.mean(np.abs(fitted - truth)))
    assert out_of_fold > 1.1 * in_sample, (out_of_fold, in_sample)
