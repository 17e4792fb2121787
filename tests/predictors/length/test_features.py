import math

import pytest

from predictors.length.features import LOG_SCALE, WINDOW_CHARS, Featurizer, window_text

CORPUS = ["user: write an essay about rivers and stars", "user: give a list of bees",
          "user: name one fact about chess", "rivers flow to the sea; stars shine",
          "a list of bees: honey bees, bumble bees", "chess is a game of kings"] * 2


def test_fast_tfidf_equals_sklearn_transform() -> None:
    """The hand-rolled encoder is the vectorizer's transform, term for term."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    from predictors.length.features import TFIDF_PARAMS

    featurizer = Featurizer.fit(CORPUS)
    vectorizer = TfidfVectorizer(**TFIDF_PARAMS).fit(CORPUS)
    for text in [*CORPUS, "bees bees bees and rivers", "nothing known here"]:
        indices, weights = featurizer.tfidf(text)
        expected = vectorizer.transform([text]).tocoo()
        assert dict(zip(indices, weights, strict=True)) == pytest.approx(
            dict(zip(expected.col.tolist(), expected.data.tolist(), strict=True)), abs=1e-6)


def test_length_features_follow_the_vocabulary() -> None:
    featurizer = Featurizer.fit(CORPUS)
    vocab = len(featurizer.idf)
    indices, weights = featurizer.encode("user: a b c", "so far", 100)
    assert indices[-2:] == [vocab, vocab + 1]
    assert weights[-2] == pytest.approx(math.log1p(4) / LOG_SCALE)
    assert weights[-1] == pytest.approx(math.log1p(100) / LOG_SCALE)
    assert featurizer.dim == vocab + 2


def test_window_keeps_prompt_and_bounded_tail() -> None:
    assert window_text("p", "") == "p"
    long = "x" * (WINDOW_CHARS + 10) + "END"
    text = window_text("prompt", long)
    assert text.startswith("prompt\n") and text.endswith("END")
    assert len(text) == len("prompt\n") + WINDOW_CHARS


def test_state_round_trip() -> None:
    featurizer = Featurizer.fit(CORPUS)
    again = Featurizer.from_state(featurizer.state())
    assert again.encode("rivers and bees", "", 0) == featurizer.encode("rivers and bees", "", 0)
