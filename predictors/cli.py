"""`laneway train length` and `laneway evaluate length`.

Train writes a versioned artifact (default `$LANEWAY_HOME/predictors/length-moe-v1`)
with one MoE predictor per expert model of the data plus "any" (all answers). Evaluate
scores it on the fixed held-out split against baselines and times it; the JSON goes to
docs/results/length_predictor.json. Both train on `id % 5 != 0` only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from predictors.base import require_artifact
from predictors.home import ALPACA_EVAL, REPO, laneway_home, read_bytes
from predictors.length.data import (
    ANY_KEY,
    Row,
    Sample,
    TokenCounter,
    arrival_rows,
    is_heldout,
    load_samples,
    samples_for,
    token_counter,
    window_rows,
)

if TYPE_CHECKING:
    from predictors.length.evaluate import Score

DEFAULT_RESULTS = REPO / "docs" / "results" / "length_predictor.json"


def default_artifact() -> Path:
    return laneway_home() / "predictors" / "length-moe-v1"


def training_rows(samples: list[Sample], counter: TokenCounter, key: str,
                  meta: dict[str, Any]) -> list[Row]:
    train = [s for s in samples_for(samples, key) if not is_heldout(s.id)]
    return arrival_rows(train) + window_rows(train, counter, meta["tau"], meta["windows"],
                                             meta["seed"])


def _train(args: argparse.Namespace) -> int:
    import torch

    from predictors.length.evaluate import cross_fit
    from predictors.length.features import Featurizer
    from predictors.length.moe import MoEConfig
    from predictors.length.predictor import save_artifact
    from predictors.length.train import train_moe

    torch.set_num_threads(args.threads)
    counter = token_counter(args.tokenizer)
    samples = load_samples(args.data, counter)
    keys = args.keys.split(",") if args.keys else [ANY_KEY, *sorted({s.key for s in samples})]
    config = MoEConfig(epochs=args.epochs, seed=args.seed)
    meta = {"tau": args.tau, "windows": args.windows, "seed": args.seed}
    featurizer = Featurizer.fit([f"{s.prompt}\n{s.output}" for s in samples
                                 if not is_heldout(s.id)])
    trained, priors = {}, {}
    for key in keys:
        started = time.monotonic()
        rows = training_rows(samples, counter, key, meta)
        trained[key] = train_moe(rows, featurizer, config)
        print(f"trained {key}: {time.monotonic() - started:.0f} s, "
              f"phase-1 rows per expert {trained[key].subset_sizes}", flush=True)
        if args.calibration_folds:
            started = time.monotonic()
            priors[key] = cross_fit(rows, featurizer, config, args.calibration_folds)
            print(f"cross-fitted {key} over {args.calibration_folds} folds: "
                  f"{time.monotonic() - started:.0f} s, {len(priors[key])} answers", flush=True)
    digest = hashlib.sha256(read_bytes(args.data)).hexdigest()[:16]
    version = f"{time.strftime('%Y%m%dT%H%M%S')}-{digest}"
    save_artifact(args.out, featurizer, trained, {
        "version": version, "data": str(args.data), "data_sha256_16": digest,
        "unit": counter.unit, "heldout": "id % 5 == 0",
        "calibration_folds": args.calibration_folds, **meta}, config, priors)
    print(f"wrote {args.out} (version {version}, lengths in {counter.unit})")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    import torch

    from predictors.length.evaluate import (
        baselines,
        evaluate_key,
        evaluate_windows,
        markdown,
        moe_method,
    )
    from predictors.length.latency import measure
    from predictors.length.predictor import config_from, load_artifact

    require_artifact(args.artifact, "laneway train length")
    torch.set_num_threads(1)
    meta = json.loads((args.artifact / "meta.json").read_text())
    unit = meta["unit"]
    counter = token_counter(unit.removeprefix("tiny-bpe:") if unit != "words" else "words")
    samples = load_samples(args.data, counter)
    predictor = load_artifact(args.artifact)
    config = replace(config_from(meta["config"]), epochs=args.epochs or meta["config"]["epochs"])
    scores, window_scores = [], []
    for key, model in predictor.models.items():
        train = training_rows(samples, counter, key, meta)
        test = [s for s in samples_for(samples, key) if is_heldout(s.id)]
        moe = moe_method(model, predictor.featurizer)
        methods = {**baselines(train, predictor.featurizer, config), "moe": moe}
        scores += evaluate_key(key, train, test, methods)
        windows = window_rows(test, counter, meta["tau"], meta["windows"], meta["seed"] + 1)
        longest = float(max(r.sample.output_tokens for r in train))
        window_scores += evaluate_windows(key, windows, moe, longest)
        print(markdown([s for s in scores if s.key == key]), flush=True)
    held = [s for s in samples if is_heldout(s.id) and s.key == args.latency_key]
    latency = measure(predictor, args.latency_key, [s.prompt for s in held],
                      [s.output for s in held])
    result = summary(meta, scores, window_scores, latency)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    pooled = [pool([s for s in scores if s.method == m and s.key != ANY_KEY])
              for m in dict.fromkeys(s.method for s in scores)]
    args.out.with_suffix(".md").write_text(
        f"Artifact {meta['version']}; lengths in {result['unit']}; held out: id % 5 == 0.\n\n"
        "Per-model predictors, pooled over the six models' held-out answers:\n\n"
        + markdown(pooled) + "\n\nEvery model:\n\n" + markdown(scores)
        + "\n\nMid-stream (tokens still to come):\n\n" + markdown(window_scores) + "\n")
    print(markdown(window_scores), json.dumps(latency), f"wrote {args.out}", sep="\n")
    return 0


def summary(meta: dict[str, Any], scores: list[Score], window_scores: list[Score],
            latency: dict[str, float]) -> dict[str, Any]:
    """The results JSON. `predictor_mae_tokens`: the per-model MoE predictors over all six
    models' held-out answers, each answer predicted by its own model's predictor."""
    pooled = {method: pool([s for s in scores if s.method == method and s.key != ANY_KEY])
              for method in dict.fromkeys(s.method for s in scores)}
    return {
        "predictor": "length_moe", "artifact_version": meta["version"],
        "unit": meta["unit"].replace(f"{REPO}/", ""), "heldout": meta["heldout"],
        "predictor_p50_ms": latency["predict_p50_ms"],
        "predictor_p99_ms": latency["predict_p99_ms"],
        "predictor_mae_tokens": round(pooled["moe"].mae, 1),
        "latency": latency, "per_model_pooled": {m: asdict(s) for m, s in pooled.items()},
        "table": [asdict(s) for s in scores], "window_table": [asdict(s) for s in window_scores],
    }


def pool(scores: list[Score]) -> Score:
    """One method's scores over several models, weighted by their held-out sizes."""
    from predictors.length.evaluate import Score

    n = sum(s.n for s in scores)

    def mean(field: str) -> float:
        return float(sum(getattr(s, field) * s.n for s in scores)) / n

    return Score("per-model", scores[0].method, mean("mae"), mean("within_25"),
                 mean("bucket_acc"), n)


def add_cli(subparsers: Any) -> None:
    train = subparsers.add_parser("train", help="train a predictor").add_subparsers(
        dest="train_command", required=True)
    length = train.add_parser("length", help="MoE-MLP output-length predictor (GoodServe)")
    length.add_argument("--data", type=Path, default=ALPACA_EVAL)
    length.add_argument("--out", type=Path, default=default_artifact())
    length.add_argument("--tokenizer", default="auto", help="auto | words | tokenizer.json")
    length.add_argument("--keys", default="", help="comma-separated; default: any + every model")
    length.add_argument("--epochs", type=int, default=500, help="per phase (the paper's)")
    length.add_argument("--windows", type=int, default=2, help="mid-stream rows per answer")
    length.add_argument("--tau", type=int, default=50, help="re-estimate every τ tokens")
    length.add_argument("--seed", type=int, default=0)
    length.add_argument("--threads", type=int, default=1)
    length.add_argument("--calibration-folds", type=int, default=2, choices=[0, *range(2, 11)],
                        help="also predict each training answer with a model trained on the "
                        "other folds and keep (predicted, true) as the artifact's length "
                        "prior (calibration.json), which goodput's calibrated lengths start "
                        "from; ~1x the training time more at 2 folds; 0: none")
    length.set_defaults(func=_train)
    from predictors.eldr import cli as eldr_cli  # ELDR's decode centroids (issue 9)

    eldr_cli.add_train(train)
    from predictors.buckets import cli as buckets_cli  # qos_drl's bucket predictors (issue 8)

    buckets_cli.add_train(train)
    evaluate = subparsers.add_parser("evaluate", help="evaluate a predictor").add_subparsers(
        dest="evaluate_command", required=True)
    length_eval = evaluate.add_parser("length", help="held-out table + latency of an artifact")
    length_eval.add_argument("--data", type=Path, default=ALPACA_EVAL)
    length_eval.add_argument("--artifact", type=Path, default=default_artifact())
    length_eval.add_argument("--out", type=Path, default=DEFAULT_RESULTS)
    length_eval.add_argument("--epochs", type=int, default=0,
                             help="baselines' MLP epochs (default: the artifact's)")
    length_eval.add_argument("--latency-key", default="gpt-3.5-turbo-1106")
    length_eval.set_defaults(func=_evaluate)
    buckets_cli.add_evaluate(evaluate)
