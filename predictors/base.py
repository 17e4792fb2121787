"""The value predictors hand to policies."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Prediction:
    """A request's predicted cost. Empty when no predictor is configured."""

    output_tokens: float | None = None


NO_PREDICTION = Prediction()
