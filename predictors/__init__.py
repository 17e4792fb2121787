"""Models that turn a request into a `Prediction` before it is routed."""

from predictors.base import NullPredictor, Predictor
from proxy.types import NO_PREDICTION, Prediction

__all__ = ["NO_PREDICTION", "NullPredictor", "Prediction", "Predictor"]
