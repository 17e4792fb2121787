"""The qos_drl experiment's fleet, impact coefficients and prompt pools.

Fleet: the six alpaca_eval experts, each on an emulator profile (GPU profiles derived
from datasheets and anchored on published vLLM figures, see their YAML). The best
experts are deliberately not all on the fastest GPUs, so quality and latency pull in
different directions, as in the paper's heterogeneous edge.

k1, k2 (Eq. 13, 14) are the least-squares slopes of the profile's step model — itself
fitted on real vLLM-CPU for the tiny-llama profiles — over a grid of prefills (step
time vs prompt tokens) and decode steps (step time vs Σ(p_i + d_{i,t}) of the batch).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from bench.emulator.profile import Profile, load_profile
from bench.studies.qos.sim import ExpertSpec, PoolPrompt
from policies.qos_drl.impact import Coefficients, fit_slope
from predictors.base import BucketEstimate, checkpoint_estimate
from predictors.buckets.data import PromptRow, fit_buckets, split

DEFAULT_FLEET = {
    "FuseChat-Llama-3.2-1B-Instruct": "t4",
    "FuseChat-Llama-3.2-3B-Instruct": "a100-40gb",
    "FuseChat-Qwen-2.5-7B-Instruct": "l40s",
    "gemma-2b-it": "h100-80gb",
    "gemma-7b-it": "a100-40gb",
    "gpt-3.5-turbo-1106": "h100-80gb",
}

# The vLLM-CPU tiny models of `bench.studies.qos.live --fleet real`, on this machine's cores: as
# in DEFAULT_FLEET the best experts (FuseChat-Qwen-7B, FuseChat-3B) are on the slow
# variant (12 layers), the others on the fast one (2 layers).
TINY_FLEET = {
    "FuseChat-Llama-3.2-1B-Instruct": "tiny-llama-small",
    "FuseChat-Llama-3.2-3B-Instruct": "tiny-llama-large",
    "FuseChat-Qwen-2.5-7B-Instruct": "tiny-llama-large",
    "gemma-2b-it": "tiny-llama-small",
    "gemma-7b-it": "tiny-llama-small",
    "gpt-3.5-turbo-1106": "tiny-llama-small",
}
# The cores the tiny fleet's engines effectively get. The machine has two, but the six
# API servers' front ends, the proxy with its predictor and the load generator use them
# too. Fitted on the live run of six real servers through `laneway serve` (the five
# policies at λ = 0.7/1/1.5, docs/results/qos_live_real.json of 2026-11-25 with agents
# trained at 2 cores): the simulator's average QoS per (policy, λ) was off by an RMS of
# 0.145 at 1 core, 0.077 at 1.25, 0.044 at 1.35, 0.083 at 1.5 and more at 2.
TINY_CORES = 1.35
# How much slower than its profile an engine runs while it is the only one with work.
# `bench.studies.qos.replay_live` replayed a live run's own decisions in the simulator (qos_drl
# and Baseline RL at λ = 1.5 on the real fleet, 2026-11-25, `bench.studies.qos.live --records`):
# with solo 1, the same requests on the same experts ran 1.13 times slower live (median per
# request) on the one busy 12-layer server of qos_drl (its engine process at 0.94 of a
# core, its API server at 0.14, the other five servers, the proxy and the client 0.3
# between them) and QoS was 0.334 live against 0.453 simulated; with 1.09 the ratio is
# 0.99 and QoS 0.332 (the two busy servers of Baseline RL: 1.09 and 0.99, unchanged by
# it). Near saturation latency grows faster than the step time, so 1.09, not 1.13.
# Checkpoints trained before it record none (1).
TINY_SOLO_SLOWDOWN = 1.09
# The paper's edge (Sec. VI-A: "each edge expert is equipped with an NVIDIA RTX 4090
# GPU"): every expert on a 4090 of its own, running its own model's shapes, so the experts'
# speeds differ by model size (1B: 3.4 ms per token alone, the 7-8B ones 20-23 ms, close
# to L = 30 ms) instead of by GPU. gpt-3.5-turbo's size is not published; it runs as
# Llama-3.1-8B (bench/emulator/gpu.py, EXPERT_MODELS).
PAPER_FLEET = {
    "FuseChat-Llama-3.2-1B-Instruct": "rtx4090-llama-3.2-1b",
    "FuseChat-Llama-3.2-3B-Instruct": "rtx4090-llama-3.2-3b",
    "FuseChat-Qwen-2.5-7B-Instruct": "rtx4090-qwen-2.5-7b",
    "gemma-2b-it": "rtx4090-gemma-2b",
    "gemma-7b-it": "rtx4090-gemma-7b",
    "gpt-3.5-turbo-1106": "rtx4090",
}
FLEETS = {"gpu": DEFAULT_FLEET, "tiny": TINY_FLEET, "paper": PAPER_FLEET}


def fit_coefficients(profile: Profile) -> Coefficients:
    step = profile.step
    prompts = [16, 64, 128, 256, 512, 768, 1024]
    prefill = [step.seconds(p, 1, step.read_context(p), p * (p + 1) // 2) for p in prompts]
    xs, ys = [], []
    for seqs in (1, 4, 8, 16, 32, 64):
        for per_seq in (128, 256, 512, 1024):
            context = seqs * per_seq
            xs.append(float(context))
            ys.append(step.seconds(seqs, seqs, seqs * step.read_context(per_seq), context))
    return Coefficients(max(0.0, fit_slope(prompts, prefill)), max(0.0, fit_slope(xs, ys)))


def fleet(experts: Sequence[str], mapping: Mapping[str, str] | None = None
          ) -> list[ExpertSpec]:
    chosen = mapping or DEFAULT_FLEET
    specs = []
    for name in experts:
        profile = load_profile(chosen[name])
        specs.append(ExpertSpec(name, profile, fit_coefficients(profile)))
    return specs


def fleet_meta(name: str) -> dict[str, Any]:
    """What a checkpoint records of the fleet it was trained on."""
    tiny = name == "tiny"
    return {"fleet": FLEETS[name], "fleet_name": name,
            "cores": TINY_CORES if tiny else None,
            "solo_slowdown": TINY_SOLO_SLOWDOWN if tiny else None}


class TrainedFleet(NamedTuple):
    mapping: dict[str, str]  # expert -> emulator profile
    cores: float | None  # the cores the engines share (None: hardware of their own)
    solo: float  # QosSim's `solo`: an engine busy alone runs this many times slower


def trained_fleet(meta: Mapping[str, Any]) -> TrainedFleet:
    """The fleet a checkpoint was trained on (the GPU fleet before the option)."""
    return TrainedFleet(dict(meta.get("fleet") or DEFAULT_FLEET), meta.get("cores"),
                        float(meta.get("solo_slowdown") or 1.0))


def agents_fleet(qos_meta: Mapping[str, Any], baseline_meta: Mapping[str, Any]
                 ) -> TrainedFleet:
    """The fleet qos_drl's and Baseline RL's checkpoints were both trained on (they are
    compared on it, so they must agree)."""
    trained = trained_fleet(qos_meta)
    if trained_fleet(baseline_meta) != trained:
        raise SystemExit("qos_drl and Baseline RL were trained on different fleets")
    return trained


class Comparison(NamedTuple):
    """What a simulator comparison of a qos_drl and a Baseline RL checkpoint runs on."""
    trained: TrainedFleet
    specs: list[ExpertSpec]  # the experts on the trained fleet's hardware
    heldout: list[PoolPrompt]
    predictions: str  # the predictions the prompts carry (`load_pools`)


def comparison(data: Path, buckets: Path | None, qos_meta: Mapping[str, Any],
               baseline_meta: Mapping[str, Any], estimate: str | None = None,
               oracle: str | None = None) -> Comparison:
    """The held-out prompts, predicted as qos_drl's checkpoint reads its buckets (or as
    `estimate` overrides), on the fleet both checkpoints were trained on."""
    trained = agents_fleet(qos_meta, baseline_meta)
    experts, _, heldout, source = load_pools(
        data, buckets, oracle=oracle, estimate=checkpoint_estimate(qos_meta, estimate))
    return Comparison(trained, fleet(experts, trained.mapping), heldout, source)


def predictions_oracle(rows: Sequence[PromptRow]) -> dict[int, tuple[list[float], list[float]]]:
    """Bucket midpoints of the true values (an upper bound for the predictors)."""
    score_b, length_b = fit_buckets(split(rows)[0])
    return {r.id: ([score_b.midpoint(score_b.label(s)) for s in r.scores],
                   [length_b.midpoint(length_b.label(d)) for d in r.lengths]) for r in rows}


def partly_oracle(model: dict[int, tuple[list[float], list[float]]],
                  oracle: dict[int, tuple[list[float], list[float]]], part: str
                  ) -> dict[int, tuple[list[float], list[float]]]:
    """`model`'s predictions with the `part` ("score" or "length") taken from `oracle`."""
    if part not in ("score", "length"):
        raise ValueError(f"oracle part must be score or length, not {part!r}")
    return {rid: ((oracle[rid][0], pred[1]) if part == "score" else (pred[0], oracle[rid][1]))
            for rid, pred in model.items()}


def predictions_model(artifact: Path, rows: Sequence[PromptRow],
                      estimate: BucketEstimate = "midpoint"
                      ) -> dict[int, tuple[list[float], list[float]]]:
    """The bucket predictor's values (`estimate`) for every prompt, cached next to the
    artifact (`prediction_cache`)."""
    cache = prediction_cache(artifact, estimate)
    version = json.loads((artifact / "meta.json").read_text())["version"]
    if cache.exists():
        cached = json.loads(cache.read_text())
        if cached["version"] == version:
            return {int(k): (v[0], v[1]) for k, v in cached["predictions"].items()}
    from predictors.buckets.predictor import load_artifact

    predictor = load_artifact(artifact, estimate=estimate)
    out: dict[int, tuple[list[float], list[float]]] = {}
    for start in range(0, len(rows), 32):
        chunk = rows[start:start + 32]
        for row, pred in zip(chunk, predictor.predict_batch([r.prompt for r in chunk]),
                             strict=True):
            out[row.id] = (list(pred.score), list(pred.length))
    # written whole, then renamed: two trainers started together (make
    # train-qos-drl-tiny) may both compute it, and neither reads the other's half
    partial = cache.with_name(f"{cache.name}.{os.getpid()}")
    partial.write_text(json.dumps({"version": version, "predictions": out}))
    os.replace(partial, cache)
    return out


def pools(rows: Sequence[PromptRow], prompt_tokens: Sequence[int],
          predictions: dict[int, tuple[list[float], list[float]]]
          ) -> tuple[list[PoolPrompt], list[PoolPrompt]]:
    """(training pool, held-out pool): ids % 5 == 0 held out."""
    prompts = [PoolPrompt(r.id, p, r.scores, tuple(max(1, d) for d in r.lengths),
                          tuple(predictions[r.id][0]),
                          tuple(predictions[r.id][1]))
               for r, p in zip(rows, prompt_tokens, strict=True)]
    return ([p for p in prompts if p.id % 5 != 0], [p for p in prompts if p.id % 5 == 0])


def prediction_cache(artifact: Path, estimate: BucketEstimate) -> Path:
    """Where `predictions_model` keeps an artifact's values of one estimate."""
    return artifact / ("predictions.json" if estimate == "midpoint"
                       else f"predictions-{estimate}.json")


def load_pools(data: Path, artifact: Path | None, tokenizer: str = "auto",
               oracle: str | None = None, estimate: BucketEstimate = "midpoint"
               ) -> tuple[list[str], list[PoolPrompt], list[PoolPrompt], str]:
    """(experts, training pool, held-out pool, predictions used) for the simulator.

    Predictions come from the bucket predictor artifact when it exists (the values
    `estimate` reads from its buckets), else from the true buckets ("oracle"). `oracle`
    "score" or "length" swaps that half of the artifact's predictions for the true
    buckets' (which half of the predictor's error costs QoS)."""
    from predictors.buckets.data import load_rows
    from predictors.length.data import token_counter

    counter = token_counter(tokenizer)
    experts, rows = load_rows(data, counter)
    prompt_tokens = counter.count_batch([r.prompt for r in rows])
    if artifact is not None and (artifact / "meta.json").exists():
        predictions = predictions_model(artifact, rows, estimate)
        source = f"bucket predictor {artifact.name}"
        if estimate != "midpoint":
            source += f", {estimate} values"
        if oracle is not None:
            predictions = partly_oracle(predictions, predictions_oracle(rows), oracle)
            source += f", oracle {oracle} buckets"
    elif oracle is not None:
        raise SystemExit(f"the oracle {oracle} buckets replace half of a bucket "
                         f"predictor's predictions, and there is none at {artifact}")
    else:
        if artifact is not None:  # named, or a default, but not there
            print(f"no bucket predictor at {artifact}: the agents see the true buckets "
                  "(oracle); `make train-buckets` writes the predictor", file=sys.stderr)
        predictions, source = predictions_oracle(rows), "oracle buckets"
    train, heldout = pools(rows, prompt_tokens, predictions)
    return experts, train, heldout, source
