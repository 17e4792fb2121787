import json
from pathlib import Path

import pytest
import torch

from predictors.base import NullPredictor
from predictors.length import load_length_predictor
from predictors.length.data import arrival_rows, load_samples, samples_for, window_rows
from predictors.length.features import Featurizer
from predictors.length.moe import FusedMoE, MoEConfig, SparseBatch
from predictors.length.predictor import LengthPredictor, load_artifact, save_artifact
from predictors.length.train import Trained, train_moe
from proxy.types import NO_PREDICTION
from tests.predictors.helpers import counter, ctx, write_data

SMALL = MoEConfig(expert_hidden=(16, 8, 8), router_hidden=8, epochs=20, batch_size=32)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Trained]]:
    root = tmp_path_factory.mktemp("artifact")
    samples = load_samples(write_data(root / "d.jsonl"), counter())
    featurizer = Featurizer.fit([f"{s.prompt}\n{s.output}" for s in samples])
    trained = {}
    for key in ["any", "big-model"]:
        mine = samples_for(samples, key)
        rows = arrival_rows(mine) + window_rows(mine, counter(), 10, 2, seed=0)
        trained[key] = train_moe(rows, featurizer, SMALL)
    save_artifact(root / "length-moe-v1", featurizer, trained, {"version": "t", "unit": "words"},
                  SMALL)
    return root / "length-moe-v1", trained


def test_round_trip_gives_identical_predictions(artifact: tuple[Path, dict[str, Trained]]) -> None:
    path, trained = artifact
    loaded = load_artifact(path, {"served-name": "big-model"})
    featurizer = loaded.featurizer
    prompts = ["user: write an essay about bees", "user: name one fact about chess", "user: hi"]
    batch = SparseBatch.of([featurizer.encode(p, "", 0) for p in prompts])
    with torch.no_grad():
        direct = trained["big-model"].model(batch) * trained["big-model"].scale
    for prompt, expected in zip(prompts, direct.tolist(), strict=True):
        got = loaded.predict(ctx(prompt, model="served-name")).output_tokens
        assert got == pytest.approx(max(1.0, expected), rel=1e-5)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format"] == 1 and set(meta["keys"]) == {"any", "big-model"}


def test_fused_forward_equals_module(artifact: tuple[Path, dict[str, Trained]]) -> None:
    path, trained = artifact
    featurizer = load_artifact(path).featurizer
    model = trained["any"].model
    fused = FusedMoE(model)
    for text, generated in [("user: give a list of rivers", 0), ("user: essay", 30)]:
        indices, weights = featurizer.encode(text, "word " * generated, generated)
        with torch.no_grad():
            expected = float(model(SparseBatch.of([(indices, weights)]))[0])
        assert fused(torch.tensor(indices), torch.tensor(weights)) == pytest.approx(
            expected, rel=1e-5, abs=1e-6)


def test_model_map_fallback_and_caps(artifact: tuple[Path, dict[str, Trained]]) -> None:
    path, _ = artifact
    mapped = load_artifact(path, {"tiny-llama": "big-model"}, fallback_key=None)
    assert mapped.key_for("tiny-llama") == "big-model"
    assert mapped.key_for("big-model") == "big-model"  # a key is its own mapping
    assert mapped.predict(ctx("user: hi", model="unknown")) == NO_PREDICTION
    assert load_artifact(path).key_for("unknown") == "any"
    capped = mapped.predict(ctx("user: write an essay about stars", "tiny-llama", max_tokens=3))
    assert capped.output_tokens == 3.0


def test_window_prediction_is_total_and_grows_with_progress(
        artifact: tuple[Path, dict[str, Trained]]) -> None:
    predictor = load_artifact(artifact[0])
    request = ctx("user: write an essay about stars and bees")
    for generated in [0, 40, 200]:
        total = predictor.predict_window(request, "word " * generated, generated).output_tokens
        assert total is not None and total >= generated + 1


def test_the_prior_round_trips_and_rides_on_its_keys_predictions(
        artifact: tuple[Path, dict[str, Trained]], tmp_path: Path) -> None:
    """An artifact trained without cross-fitting has no prior; one with it gives each
    prediction its key's (predicted, true) pairs, one shared object per key."""
    plain = load_artifact(artifact[0]).predict(ctx("user: hi"))
    assert plain.output_tokens is not None and plain.length_prior is None
    featurizer = Featurizer.from_state(json.loads((artifact[0] / "featurizer.json").read_text()))
    priors = {"any": [(120.456, 300), (80.0, 40)], "big-model": [(500.0, 900)]}
    save_artifact(tmp_path / "with-prior", featurizer, artifact[1],
                  {"version": "t", "unit": "words"}, SMALL, priors)
    loaded = load_artifact(tmp_path / "with-prior", {"served-name": "big-model"})
    first, second = (loaded.predict(ctx(p, model="served-name")) for p in ("user: a", "user: b"))
    assert first.length_prior is not None and first.length_prior is second.length_prior
    assert (first.length_prior.key, first.length_prior.samples) == ("big-model", ((500.0, 900),))
    fallback = loaded.predict_window(ctx("user: hi", model="unknown"), "so far", 2).length_prior
    assert fallback is not None and fallback.samples == ((120.46, 300), (80.0, 40))


def test_loader_without_artifact_predicts_nothing(artifact: tuple[Path, dict[str, Trained]]
                                                  ) -> None:
    none = load_length_predictor(None, {}, "any")
    assert isinstance(none, NullPredictor)
    assert none.predict(ctx("user: hi")) == NO_PREDICTION
    assert none.predict_window(ctx("user: hi"), "so far", 2) == NO_PREDICTION
    assert isinstance(load_length_predictor(artifact[0], {}, "any"), LengthPredictor)


def test_loader_rejects_other_artifacts(tmp_path: Path) -> None:
    (tmp_path / "meta.json").write_text(json.dumps({"format": 99, "kind": "length_moe"}))
    with pytest.raises(ValueError, match="format"):
        load_artifact(tmp_path)
