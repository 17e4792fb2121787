"""`laneway train buckets` and `laneway evaluate buckets`.

Train fine-tunes the MiniLM bucket predictor on the training split (ids % 5 != 0) and
writes a versioned artifact (default `$LANEWAY_HOME/predictors/buckets-minilm-v1`);
with `--distill-from` it distils a trained artifact into a smaller student instead
(default `.../buckets-minilm-l3-distilled`, what qos_drl decides with).
Evaluate scores it on the held-out split against the paper's figures and a TF-IDF +
logistic regression baseline, times it on CPU (PyTorch float, and each `--runtime`
asked for: `METHODS` names its row), and writes docs/results/bucket_predictor.{json,md}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from predictors.base import BUCKET_RUNTIMES, require_artifact
from predictors.home import ALPACA_EVAL, REPO, laneway_home, read_bytes

DEFAULT_RESULTS = REPO / "docs" / "results" / "bucket_predictor.json"
PAPER = {"top1_score": 0.6339, "top3_score": 0.9778, "top1_length": 0.7297,
         "top3_length": 0.8471}
METHODS = {"torch": "minilm", "torch-int8": "minilm_int8", "onnx": "minilm_onnx",
           "onnx-int8": "minilm_onnx_int8"}  # row of each runtime in the results


def default_artifact() -> Path:
    """The 6-layer predictor `laneway train buckets` fine-tunes: the teacher, and the
    predictions `python -m bench train qos-drl` trains the agent on."""
    return laneway_home() / "predictors" / "buckets-minilm-v1"


def distilled_artifact() -> Path:
    """Its 3-layer distillation (`--distill-from`): what qos_drl decides with (docs/qos_drl.md)."""
    return laneway_home() / "predictors" / "buckets-minilm-l3-distilled"


def _train(args: argparse.Namespace) -> int:
    import torch

    from predictors.buckets.data import fit_buckets, labels, load_rows, split
    from predictors.buckets.predictor import new_model, save_artifact
    from predictors.buckets.train import TrainConfig, train_model
    from predictors.length.data import token_counter

    torch.set_num_threads(args.threads)
    counter = token_counter(args.tokenizer)
    experts, rows = load_rows(args.data, counter)
    train, _ = split(rows)
    score_b, length_b = fit_buckets(train)
    torch.manual_seed(args.seed)  # the heads' and the expert tokens' initial weights
    distill = None
    origin: dict[str, Any] = {}
    if args.distill_from is None:
        out = args.out or default_artifact()
        model, tokenizer = new_model(experts, args.layers)
    else:
        out = args.out or distilled_artifact()
        if out.resolve() == args.distill_from.resolve():
            raise SystemExit(f"--out {out}: would overwrite the teacher it distils")
        model, tokenizer, distill, origin = _student(args, experts, score_b.top, length_b.top)
    config = TrainConfig(epochs=args.epochs, max_len=args.max_len, seed=args.seed)
    started = time.monotonic()
    losses = train_model(model, tokenizer, train, *labels(train, score_b, length_b), config,
                         distill=distill)
    digest = hashlib.sha256(read_bytes(args.data)).hexdigest()[:16]
    version = f"{time.strftime('%Y%m%dT%H%M%S')}-{digest}"
    save_artifact(out, model, tokenizer, {
        "version": version, "experts": experts, "score_top": score_b.top,
        "length_top": length_b.top, "max_len": args.max_len,
        "layers": int(model.encoder.config.num_hidden_layers), "epochs": args.epochs,
        "seed": args.seed, "unit": counter.unit.replace(f"{REPO}/", ""),
        "score": "win_rate_vs_reference", "heldout": "id % 5 == 0", "losses": losses,
        "train_s": round(time.monotonic() - started, 1), "data_sha256_16": digest,
        **origin})
    print(f"wrote {out} (version {version}, {time.monotonic() - started:.0f} s)")
    return 0


def _student(args: argparse.Namespace, experts: list[str], score_top: float,
             length_top: float) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(student, tokenizer, Distill, meta) for `--distill-from`: the teacher artifact's
    encoder cut to `--layers` of its layers, evenly spread, its heads and tokenizer."""
    from transformers import AutoTokenizer

    from predictors.buckets.predictor import artifact_layers, load_model, spread_layers, student_of
    from predictors.buckets.train import Distill

    teacher_dir: Path = args.distill_from
    meta = json.loads((teacher_dir / "meta.json").read_text())
    if meta["experts"] != experts or (meta["score_top"], meta["length_top"]) != (
            score_top, length_top):
        raise SystemExit(f"{teacher_dir}: trained on other experts or buckets than --data")
    keep = spread_layers(artifact_layers(teacher_dir), args.layers or 3)
    teacher = load_model(teacher_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir / "encoder", local_files_only=True)
    distill = Distill(teacher, args.distill_temperature, args.distill_alpha)
    origin = {"distilled_from": meta["version"], "teacher_layers_kept": keep,
              "distill_temperature": distill.temperature, "distill_alpha": distill.alpha}
    print(f"student: teacher {meta['version']}'s layers {keep}")
    return student_of(teacher, keep), tokenizer, distill, origin


def _evaluate(args: argparse.Namespace) -> int:
    import torch

    from predictors.buckets.data import Buckets, labels, load_rows, split
    from predictors.buckets.predictor import artifact_layers, load_artifact
    from predictors.buckets.train import (
        encoder_scores,
        latency,
        majority_scores,
        tfidf_scores,
    )
    from predictors.length.data import token_counter

    require_artifact(args.artifact, "laneway train buckets")
    torch.set_num_threads(1)
    meta = json.loads((args.artifact / "meta.json").read_text())
    unit = str(meta["unit"])
    counter = token_counter(unit.removeprefix("tiny-bpe:") if unit != "words" else "words")
    _, rows = load_rows(args.data, counter)
    train, test = split(rows)
    score_b, length_b = Buckets(meta["score_top"]), Buckets(meta["length_top"])
    test_labels = labels(test, score_b, length_b)
    train_labels = labels(train, score_b, length_b)
    prompts = [r.prompt for r in test]
    asked = {"torch", *(args.runtime or []), *(["torch-int8"] if args.int8 else [])}
    methods: dict[str, dict[str, float]] = {}
    timing: dict[str, dict[str, float]] = {}
    for runtime in (r for r in BUCKET_RUNTIMES if r in asked):
        predictor = load_artifact(args.artifact, runtime, args.max_len)
        methods[METHODS[runtime]] = encoder_scores(predictor, test, *test_labels)
        timing[METHODS[runtime]] = latency(predictor, prompts, (1, 4, 8, 16))
    methods |= {"tfidf_logreg": tfidf_scores(train, test, train_labels, test_labels),
                "majority_bucket": majority_scores(train_labels, test_labels),
                "paper_distilbert": PAPER}
    inference = {"layers": artifact_layers(args.artifact),
                 "max_len": args.max_len or int(meta["max_len"])}
    result = summary(meta, inference, methods, timing, len(test))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result), f"wrote {args.out}", sep="\n")
    return 0


def summary(meta: dict[str, Any], inference: dict[str, int],
            methods: dict[str, dict[str, float]], timing: dict[str, dict[str, float]],
            n_prompts: int) -> dict[str, Any]:
    """`inference`: the encoder's layers and the max_len prompts were cut to here."""
    return {"predictor": "buckets_minilm", "artifact_version": meta["version"],
            "layers": inference["layers"], "inference_max_len": inference["max_len"],
            "experts": meta["experts"], "score": meta["score"], "unit": meta["unit"],
            "heldout": meta["heldout"], "heldout_prompts": n_prompts,
            "pairs": n_prompts * len(meta["experts"]), "buckets": 10,
            "score_top": meta["score_top"], "length_top": meta["length_top"],
            "training": {k: meta[k] for k in ("epochs", "max_len", "train_s", "losses")},
            "methods": methods, "latency_cpu_1_thread": timing}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"Artifact {result['artifact_version']} ({result['layers']} encoder layers, "
             f"prompts cut to {result['inference_max_len']} tokens); "
             f"score = {result['score']}, length in "
             f"{result['unit']}; held out {result['heldout']} ({result['pairs']} "
             "prompt-expert pairs); 10 equal-width buckets.\n",
             "| method | top-1 score | top-3 score | top-1 length | top-3 length |",
             "|---|---|---|---|---|"]
    for name, m in result["methods"].items():
        lines.append(f"| {name} | {m['top1_score']:.1%} | {m['top3_score']:.1%} | "
                     f"{m['top1_length']:.1%} | {m['top3_length']:.1%} |")
    for name, timing in result["latency_cpu_1_thread"].items():
        lines.append(f"\nCPU latency of {name} (1 thread), ms per request: " + ", ".join(
            f"{k} {v:.1f}" for k, v in timing.items()))
    return "\n".join(lines) + "\n"


def add_train(train: Any) -> None:
    p = train.add_parser("buckets", help="MiniLM score/length bucket predictors (qos_drl)")
    p.add_argument("--data", type=Path, default=ALPACA_EVAL)
    p.add_argument("--out", type=Path, default=None, help="default: "
                   f"{default_artifact()}, or with --distill-from {distilled_artifact()}")
    p.add_argument("--tokenizer", default="auto", help="auto | words | tokenizer.json")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=None,
                   help="keep the first N transformer layers of MiniLM (default: all 6); "
                   "with --distill-from, N of the teacher's, evenly spread (default 3)")
    p.add_argument("--distill-from", type=Path, default=None, metavar="ARTIFACT",
                   help="distil this trained artifact into a smaller student")
    p.add_argument("--distill-temperature", type=float, default=2.0)
    p.add_argument("--distill-alpha", type=float, default=0.5,
                   help="weight of the teacher's soft targets (the labels get 1 - alpha)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(func=_train)


def add_evaluate(evaluate: Any) -> None:
    p = evaluate.add_parser("buckets", help="held-out top-1/top-3 + latency of buckets")
    p.add_argument("--data", type=Path, default=ALPACA_EVAL)
    p.add_argument("--artifact", type=Path, default=default_artifact())
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS)
    p.add_argument("--runtime", action="append", choices=BUCKET_RUNTIMES,
                   help="also this runtime (repeatable; qos_drl's `buckets_runtime`)")
    p.add_argument("--int8", action="store_true", help="the same as --runtime torch-int8")
    p.add_argument("--max-len", type=int, default=None,
                   help="cut prompts to N tokens (default: the artifact's training max_len)")
    p.set_defaults(func=_evaluate)
