"""Training rows for the output-length predictor, from the alpaca_eval experts file.

Each of the 805 prompts has six real answers, one per expert model. Lengths are
counted here, never taken from the data: with the tiny models' byte-level BPE
(`tokenizer.json` of `python -m bench backends build`, the tokenizer the local fleet really
uses) when it is built, else one token per whitespace-separated word (an
approximation: the BPE averages ~2.5 tokens per word). `TokenCounter.unit` says which
and goes into the artifact.

A row is one point in a generation: the prompt, the answer generated so far (empty at
arrival) and the tokens still to come. Mid-stream rows are what the re-estimation
every τ tokens (GoodServe §3.4) sees, so the same predictor serves both calls.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from predictors.home import open_text

ANY_KEY = "any"  # the predictor trained on every expert's answers
HELDOUT_MODULUS = 5  # fixed split: ids % 5 == 0 are held out, never trained on


def is_heldout(sample_id: int) -> bool:
    return sample_id % HELDOUT_MODULUS == 0


def chat_prompt(instruction: str) -> str:
    """The proxy's `prompt_text` of a one-message chat request (proxy/request_context.py)."""
    return f"user: {instruction}"


@dataclass(frozen=True, slots=True)
class Sample:
    """One expert's answer to one prompt."""

    id: int
    key: str  # the expert model that answered
    prompt: str
    output: str
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Row:
    """A training/evaluation point: features come from `prompt` + `generated_text`."""

    sample: Sample
    generated_text: str
    generated_tokens: int

    @property
    def remaining(self) -> int:
        return self.sample.output_tokens - self.generated_tokens


@dataclass(frozen=True, slots=True)
class TokenCounter:
    unit: str  # "tiny-bpe:<path>" or "words"
    encode_batch: Callable[[Sequence[str]], list[list[tuple[int, int]]]]  # token char spans

    def count_batch(self, texts: Sequence[str]) -> list[int]:
        return [len(spans) for spans in self.encode_batch(texts)]


def token_counter(spec: str = "auto") -> TokenCounter:
    """`spec`: a tokenizer.json path, "auto" (the small tiny model's, if built) or "words"."""
    if spec == "words":
        return TokenCounter("words", _word_spans)
    if spec == "auto":
        from predictors.home import tiny_model_dir  # offline training only; no model build

        path = tiny_model_dir("small") / "tokenizer.json"
        if not path.exists():
            return TokenCounter("words", _word_spans)
    else:
        path = Path(spec)
    from tokenizers import Tokenizer

    tokenizer: Any = Tokenizer.from_file(str(path))

    def encode(texts: Sequence[str]) -> list[list[tuple[int, int]]]:
        return [list(e.offsets) for e in tokenizer.encode_batch(list(texts))]

    return TokenCounter(f"tiny-bpe:{path}", encode)


def _word_spans(texts: Sequence[str]) -> list[list[tuple[int, int]]]:
    import re

    return [[m.span() for m in re.finditer(r"\S+", text)] for text in texts]


def load_samples(path: Path, counter: TokenCounter) -> list[Sample]:
    """Every (prompt, expert answer) pair of the file, lengths counted by `counter`."""
    with open_text(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    pairs = [(r, key) for r in records for key in sorted(r["experts"])]
    prompts = [chat_prompt(r["instruction"]) for r, _ in pairs]
    outputs = [r["experts"][key]["output"] for r, key in pairs]
    prompt_lengths = counter.count_batch(prompts)
    output_lengths = counter.count_batch(outputs)
    return [
        Sample(int(r["id"]), key, prompt, output, p_len, o_len)
        for (r, key), prompt, output, p_len, o_len
        in zip(pairs, prompts, outputs, prompt_lengths, output_lengths, strict=True)
    ]


def samples_for(samples: Sequence[Sample], key: str) -> list[Sample]:
    return list(samples) if key == ANY_KEY else [s for s in samples if s.key == key]


def arrival_rows(samples: Sequence[Sample]) -> list[Row]:
    return [Row(s, "", 0) for s in samples]


def window_rows(samples: Sequence[Sample], counter: TokenCounter, tau: int,
                per_answer: int, seed: int) -> list[Row]:
    """Up to `per_answer` mid-stream rows per answer, at seeded multiples of τ tokens.

    Sampled rather than all of them: a 4000-token answer has 80 checkpoints and would
    outweigh short answers; a few per answer keep training light and balanced.
    """
    rng = random.Random(seed)
    spans = counter.encode_batch([s.output for s in samples])
    rows: list[Row] = []
    for sample, token_spans in zip(samples, spans, strict=True):
        checkpoints = list(range(tau, len(token_spans), tau))
        for generated in sorted(rng.sample(checkpoints, min(per_answer, len(checkpoints)))):
            text = sample.output[: token_spans[generated - 1][1]]
            rows.append(Row(sample, text, generated))
    return rows
