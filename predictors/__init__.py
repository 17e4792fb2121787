"""Models that turn a request into a `Prediction` before it is routed."""

from predictors.base import NO_PREDICTION, NullPredictor, Prediction, Predictor

__all__ = ["NO_PREDICTION", "NullPredictor", "Prediction", "Predictor"]
