"""Training text for the trained tiny MoE (`moe-lm`), disjoint from the ELDR prompts.

The same six domains as `bench/studies/eldr/prompts.py`, from other material: alpaca_eval
instructions with their reference answers from row `PROSE_FROM` on (the study's prose
prompts are the first rows' instructions); 12-line windows of the Python files in
bench/ and predictors/ (the study's code comes from proxy/ and policies/); arithmetic
problems and locale phrases drawn with another seed. A language model trained on it
continues a domain's prompt in that domain, as a real MoE does, which a random-weight
model does not.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from bench.studies.eldr.prompts import code_windows, language_words, math_problem, phrase
from predictors.home import open_text

PROSE_FROM = 200  # rows below this are left to the study's prompts
TRAIN_CODE = ("bench", "predictors")
_SEED = 1000


def training_texts(shared: Path, per_domain: int = 400, seed: int = _SEED
                   ) -> list[tuple[str, str]]:
    """(domain, text) pairs: up to `per_domain` of each domain, in a seeded order."""
    rng = random.Random(seed)
    pools: dict[str, list[str]] = {"prose": _prose(shared, per_domain),
                                   "code": list(code_windows(TRAIN_CODE))[:per_domain],
                                   "math": [math_problem(rng) for _ in range(per_domain)]}
    for language, words in language_words().items():
        pools[language] = [phrase(rng, words) for _ in range(per_domain)]
    pairs = [(domain, text) for domain, texts in pools.items() for text in texts]
    rng.shuffle(pairs)
    return pairs


def _prose(shared: Path, limit: int) -> list[str]:
    texts: list[str] = []
    with open_text(shared / "data" / "alpaca_eval_experts.jsonl") as f:
        for line in f:
            row = json.loads(line)
            if row["id"] >= PROSE_FROM and len(texts) < limit:
                texts.append(f"{row['instruction']}\n{row['reference']}")
    return texts
