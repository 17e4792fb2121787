"""Domain-labelled prompts for the ELDR study, from material on this machine.

* `prose`: alpaca_eval instructions (datasets/data).
* `code`: 12-line windows of laneway's own Python source.
* `math`: generated arithmetic and algebra problems (synthetic, seeded).
* `ru`, `zh`, `ja`: phrases assembled from glibc's locale data
  (/usr/share/i18n/locales: day and month names, yes/no words, ...). A small
  vocabulary, but in the language's own script; skipped if the files are absent.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

from bench.models.tiny_models import instructions
from predictors.home import REPO

LOCALES = {"ru": "ru_RU", "zh": "zh_CN", "ja": "ja_JP"}
EVAL_CODE = ("proxy", "policies")  # the code prompts' source; a trained MoE learns from others
LOCALE_DIR = Path("/usr/share/i18n/locales")
_QUOTED = re.compile(r'"([^"]+)"')
_CODEPOINT = re.compile(r"<U([0-9A-Fa-f]{4,5})>")


def domain_prompts(shared: Path, per_domain: int, seed: int = 0) -> list[tuple[str, str]]:
    """(domain, prompt) pairs, `per_domain` of each available domain, shuffled."""
    rng = random.Random(seed)
    pools: dict[str, list[str]] = {
        "prose": list(islice(instructions(shared), per_domain)),
        "code": list(islice(code_windows(EVAL_CODE), per_domain)),
        "math": [math_problem(rng) for _ in range(per_domain)],
    }
    for language, words in language_words().items():
        pools[language] = [phrase(rng, words) for _ in range(per_domain)]
    pairs = [(domain, text) for domain, texts in pools.items() for text in texts]
    rng.shuffle(pairs)
    return pairs


def language_words() -> dict[str, list[str]]:
    """Each language's words from glibc's locale data (languages without enough: left out)."""
    found = {language: _locale_words(LOCALE_DIR / locale) for language, locale in LOCALES.items()}
    return {language: words for language, words in found.items() if len(words) >= 20}


def phrase(rng: random.Random, words: list[str]) -> str:
    return " ".join(rng.choices(words, k=rng.randint(12, 40)))


def code_windows(folders: tuple[str, ...], lines_per_prompt: int = 12) -> Iterator[str]:
    """12-line windows of the Python files in these folders of the repository."""
    paths = [path for folder in folders for path in sorted((REPO / folder).rglob("*.py"))]
    for path in paths:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        for start in range(0, len(lines) - lines_per_prompt, lines_per_prompt):
            yield "\n".join(lines[start:start + lines_per_prompt])


def math_problem(rng: random.Random) -> str:
    a, b, c, d = (rng.randint(2, 99) for _ in range(4))
    forms = [
        f"Solve for x: {a}x + {b} = {c}. Then compute {d} * {a} - {b} / {c}.",
        f"What is the derivative of {a}x^3 - {b}x^2 + {c}x - {d}? Evaluate it at x = 2.",
        f"Compute the sum of the first {a} terms of the arithmetic sequence {b}, "
        f"{b + c}, {b + 2 * c}, ... and divide it by {d}.",
        f"Find the integral of ({a}x + {b})^2 dx from 0 to {c % 9 + 1}, then add {d}.",
    ]
    return rng.choice(forms)


def _locale_words(path: Path) -> list[str]:
    if not path.exists():
        return []
    words: list[str] = []
    quoted_strings = (q for line in path.read_text(errors="replace").splitlines()
                      if not line.startswith("%") for q in _QUOTED.findall(line))
    for quoted in quoted_strings:
        if "<U" not in quoted:
            continue
        text = _CODEPOINT.sub(lambda m: chr(int(m.group(1), 16)), quoted)
        if any(ord(ch) > 0x7F for ch in text) and ";" not in text:
            words.append(text.strip("^[]+-"))
    return [w for w in words if w.isalpha()]
