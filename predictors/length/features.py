"""TF-IDF features of a request's token window, as sparse (index, weight) pairs.

scikit-learn's `TfidfVectorizer` fits the vocabulary and the idf weights; requests are
then encoded here from its analyzer, vocabulary and idf, with the same formula
(sublinear tf x idf, l2-normalised). The reason is cost: `transform([text])` takes
~650 µs per call (sparse-matrix machinery), this path ~40 µs, and the predictor's
whole budget is 1 ms. `tests/predictors` checks both give the same vector.

Two length features follow the vocabulary (indices D and D+1): log prompt words and
log tokens generated so far. TF-IDF is l2-normalised and so carries no length at all,
yet the paper's experts are specialised by input-length tier, and a mid-stream
estimate must know how far the answer already is.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

WINDOW_CHARS = 4096  # of generated text seen mid-stream: bounds the cost of a re-estimate
LOG_SCALE = math.log(8192.0)  # brings the log-length features to about [0, 1]
TFIDF_PARAMS: dict[str, Any] = {
    "ngram_range": (1, 2), "min_df": 2, "max_features": 1024, "sublinear_tf": True,
}

SparseRow = tuple[list[int], list[float]]


def window_text(prompt: str, generated_text: str) -> str:
    """What the TF-IDF sees: the prompt and the tail of the answer so far."""
    if not generated_text:
        return prompt
    return f"{prompt}\n{generated_text[-WINDOW_CHARS:]}"


@dataclass(frozen=True, slots=True)
class Featurizer:
    vocabulary: dict[str, int]
    idf: tuple[float, ...]
    analyzer: Callable[[str], list[str]]

    @property
    def dim(self) -> int:
        return len(self.idf) + 2

    @classmethod
    def fit(cls, texts: Sequence[str]) -> Featurizer:
        from sklearn.feature_extraction.text import TfidfVectorizer

        vectorizer = TfidfVectorizer(**TFIDF_PARAMS).fit(texts)
        vocabulary = {term: int(i) for term, i in vectorizer.vocabulary_.items()}
        return cls(vocabulary, tuple(float(x) for x in vectorizer.idf_), analyzer_for())

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Featurizer:
        return cls(dict(state["vocabulary"]), tuple(state["idf"]), analyzer_for())

    def state(self) -> dict[str, Any]:
        return {"params": {**TFIDF_PARAMS, "ngram_range": list(TFIDF_PARAMS["ngram_range"])},
                "vocabulary": self.vocabulary, "idf": list(self.idf)}

    def encode(self, prompt: str, generated_text: str, generated_tokens: int) -> SparseRow:
        indices, weights = self.tfidf(window_text(prompt, generated_text))
        indices += [len(self.idf), len(self.idf) + 1]
        weights += [math.log1p(len(prompt.split())) / LOG_SCALE,
                    math.log1p(generated_tokens) / LOG_SCALE]
        return indices, weights

    def tfidf(self, text: str) -> SparseRow:
        indices: list[int] = []
        weights: list[float] = []
        for term, count in Counter(self.analyzer(text)).items():
            index = self.vocabulary.get(term)
            if index is not None:
                indices.append(index)
                weights.append((1.0 + math.log(count)) * self.idf[index])
        norm = math.sqrt(sum(w * w for w in weights)) or 1.0
        return indices, [w / norm for w in weights]


def analyzer_for() -> Callable[[str], list[str]]:
    """The vectorizer's tokenisation (lowercase, word n-grams) without a fitted model."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    analyzer: Callable[[str], list[str]] = TfidfVectorizer(**TFIDF_PARAMS).build_analyzer()
    return analyzer
