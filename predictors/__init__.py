"""Models that turn a request into a `Prediction` before it is routed."""

from predictors.base import Prediction

__all__ = ["Prediction"]
