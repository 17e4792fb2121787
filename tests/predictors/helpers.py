"""A small synthetic length dataset: the prompt's words decide the answer length."""

from __future__ import annotations

import json
import random
from pathlib import Path

from predictors.length.data import Sample, TokenCounter, token_counter
from proxy.types import RequestContext

WORDS = token_counter("words")
TOPICS = ["rivers", "stars", "bread", "trains", "music", "glaciers", "chess", "bees"]
MODELS = ["big-model", "small-model"]


def answer_length(instruction: str, model: str) -> int:
    base = 160 if "essay" in instruction else 40 if "list" in instruction else 8
    return base * (2 if model == "big-model" else 1)


def write_data(path: Path, prompts: int = 60, seed: int = 0) -> Path:
    """An alpaca_eval-shaped file with two expert models."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(prompts):
            kind = ["write an essay about", "give a list of", "name one fact about"][i % 3]
            words = " ".join(rng.choice(TOPICS) for _ in range(1 + i % 5))
            instruction = f"{kind} {words}"
            experts = {m: {"output": " ".join(["word"] * answer_length(instruction, m)),
                           "win_rate_vs_reference": 0.5} for m in MODELS}
            f.write(json.dumps({"id": i, "dataset": "synthetic", "instruction": instruction,
                                "reference": "", "experts": experts}) + "\n")
    return path


def counter() -> TokenCounter:
    return WORDS


def sample(sample_id: int, prompt_tokens: int, output_tokens: int) -> Sample:
    return Sample(sample_id, "m", "user: x", "word " * output_tokens, prompt_tokens,
                  output_tokens)


def ctx(prompt: str, model: str = "big-model", max_tokens: int | None = None) -> RequestContext:
    return RequestContext(request_id="r", endpoint="chat", model=model, prompt_text=prompt,
                          prompt_blocks=(), stream=True, max_tokens=max_tokens)


def tiny_length_artifact(root: Path) -> Path:
    """A length-predictor artifact (key `any`) trained in seconds on `write_data`'s
    prompts, for tests that run it through the proxy."""
    from predictors.length.data import arrival_rows, load_samples, samples_for
    from predictors.length.features import Featurizer
    from predictors.length.moe import MoEConfig
    from predictors.length.predictor import save_artifact
    from predictors.length.train import train_moe

    root.mkdir(parents=True, exist_ok=True)
    samples = load_samples(write_data(root / "d.jsonl"), counter())
    featurizer = Featurizer.fit([f"{s.prompt}\n{s.output}" for s in samples])
    config = MoEConfig(expert_hidden=(16, 8, 8), router_hidden=8, epochs=20, batch_size=32)
    artifact = root / "length-moe-v1"
    save_artifact(artifact, featurizer, {"any": train_moe(
        arrival_rows(samples_for(samples, "any")), featurizer, config)},
        {"version": "t", "unit": "words"}, config)
    return artifact
