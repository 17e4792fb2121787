"""Texts of an exact token length, and token counts, for building workloads.

With the tiny models' byte-level BPE (`tokenizer.json` of a built tiny model, see
`bench.models.tiny_models`) a prompt of n tokens is n words each of which is one token when
preceded by a space: the pre-tokenizer splits at every space, so concatenated words
(and concatenated blocks of words) never merge, and lengths are exact. Without the
tokenizer the fallback counts one token per word, an approximation (the tiny BPE
averages ~2.5 tokens per English word of free text); `Lexicon.exact` says which.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from predictors.home import open_text, tiny_model_dir

# Tokens the tiny models' chat template adds around one user message:
# `<|user|>` + content + `\n` + `<|assistant|>`.
CHAT_TEMPLATE_TOKENS = 3


@dataclass(frozen=True, slots=True)
class Lexicon:
    name: str  # "tiny-bpe:<path>" or "words"
    exact: bool  # token counts are the backends' own, not an approximation
    words: tuple[str, ...]  # each is exactly (or about) one token after a space
    count_batch: Callable[[Sequence[str]], list[int]]

    def count(self, text: str) -> int:
        return self.count_batch([text])[0]

    def text(self, tokens: int, rng: random.Random) -> str:
        """A text of `tokens` tokens (words drawn by `rng`), starting with a space."""
        return "".join(" " + rng.choice(self.words) for _ in range(tokens))


def load_lexicon(spec: str, fallback_texts: Sequence[str]) -> Lexicon:
    """`spec`: a tokenizer.json path, "auto" (the small tiny model's, if built) or "words"."""
    if spec == "words":
        return words_lexicon(fallback_texts)
    path = tiny_model_dir("small") / "tokenizer.json" if spec == "auto" else Path(spec)
    if spec == "auto" and not path.exists():
        return words_lexicon(fallback_texts)
    return bpe_lexicon(path)


def bpe_lexicon(path: Path) -> Lexicon:
    from tokenizers import Tokenizer

    tokenizer: Any = Tokenizer.from_file(str(path))
    vocab: dict[str, int] = tokenizer.get_vocab()
    # "Ġ" marks a leading space in byte-level BPE; keep plain lowercase words.
    candidates = sorted(t[1:] for t in vocab if t.startswith("Ġ") and t[1:].isascii()
                        and t[1:].isalpha() and t[1:].islower() and len(t) >= 4)
    encoded = tokenizer.encode_batch([" " + w for w in candidates])
    words = tuple(w for w, e in zip(candidates, encoded, strict=True) if len(e.ids) == 1)
    if len(words) < 50:
        raise ValueError(f"{path}: too few single-token words ({len(words)})")

    def count_batch(texts: Sequence[str]) -> list[int]:
        return [len(e.ids) for e in tokenizer.encode_batch(list(texts))]

    return Lexicon(f"tiny-bpe:{path}", True, words, count_batch)


def words_lexicon(texts: Sequence[str]) -> Lexicon:
    pool = sorted({w for t in texts for w in t.lower().split() if w.isascii() and w.isalpha()})
    if len(pool) < 50:
        raise ValueError("too few words to build prompts from")

    def count_batch(batch: Sequence[str]) -> list[int]:
        return [len(t.split()) for t in batch]

    return Lexicon("words", False, tuple(pool), count_batch)


def alpaca_rows(shared: Path) -> list[dict[str, Any]]:
    with open_text(shared / "data" / "alpaca_eval_experts.jsonl") as f:
        return [json.loads(line) for line in f]


def truncate(lexicon: Lexicon, text: str, tokens: int) -> str:
    """The longest word prefix of `text` that has at most `tokens` tokens."""
    words = text.split(" ")
    low, high = 0, len(words)  # invariant: prefix of `low` words fits
    while low < high:
        mid = (low + high + 1) // 2
        if lexicon.count(" ".join(words[:mid])) <= tokens:
            low = mid
        else:
            high = mid - 1
    return " ".join(words[:low])
