"""Rows and labels for the bucket predictors (qos_drl_edge_routing.txt §V-B1).

One row per prompt of the alpaca_eval experts file, with every expert's generation
score and output length. The score is the judge's `win_rate_vs_reference` (in
[0, 1]); the length is counted by the project (`predictors.length.data.TokenCounter`:
the tiny models' BPE when built, else words). Labels are 10 equal-width buckets over
[0, max] as in the paper ("max generation score / number of buckets"), the maxima
taken over the training split only. Held out: ids % 5 == 0 (`is_heldout`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from predictors.home import open_text
from predictors.length.data import TokenCounter, chat_prompt, is_heldout

N_BUCKETS = 10


@dataclass(frozen=True, slots=True)
class PromptRow:
    """One prompt and, per expert (in `experts` order), its score and output length."""

    id: int
    prompt: str
    scores: tuple[float, ...]
    lengths: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Buckets:
    """Equal-width bucketing of [0, top] into `n` buckets; values above top go last."""

    top: float
    n: int = N_BUCKETS

    def label(self, value: float) -> int:
        return min(self.n - 1, max(0, int(value / self.top * self.n)))

    def midpoint(self, bucket: int) -> float:
        return (bucket + 0.5) * self.top / self.n


def load_rows(path: Path, counter: TokenCounter) -> tuple[list[str], list[PromptRow]]:
    """(expert names, sorted; one row per prompt) with lengths counted by `counter`."""
    with open_text(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    experts = sorted(records[0]["experts"])
    outputs = [r["experts"][e]["output"] for r in records for e in experts]
    counts = counter.count_batch(outputs)
    n = len(experts)
    rows = [
        PromptRow(
            int(r["id"]), chat_prompt(r["instruction"]),
            tuple(float(r["experts"][e]["win_rate_vs_reference"]) for e in experts),
            tuple(counts[i * n:(i + 1) * n]))
        for i, r in enumerate(records)
    ]
    return experts, rows


def split(rows: Sequence[PromptRow]) -> tuple[list[PromptRow], list[PromptRow]]:
    """(train, held out): the fixed split of the project, ids % 5 == 0 held out."""
    return ([r for r in rows if not is_heldout(r.id)], [r for r in rows if is_heldout(r.id)])


def fit_buckets(train: Sequence[PromptRow]) -> tuple[Buckets, Buckets]:
    """(score buckets, length buckets), widths from the training maxima."""
    top_score = max(max(r.scores) for r in train)
    top_length = max(max(r.lengths) for r in train)
    return Buckets(top_score), Buckets(float(top_length))


def labels(rows: Sequence[PromptRow], score: Buckets, length: Buckets
           ) -> tuple[list[list[int]], list[list[int]]]:
    """Per row, per expert: (score bucket labels, length bucket labels)."""
    return ([[score.label(s) for s in r.scores] for r in rows],
            [[length.label(d) for d in r.lengths] for r in rows])
