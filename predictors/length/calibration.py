"""Calibrated output lengths: a quantile of what requests predicted alike really ran to.

The length predictor gives one number per request (GoodServe's L_out); its errors are
wide and skewed (a request predicted at 100 tokens may run to 600), and Algorithm 1
sends a request predicted short to the slowest backend that meets its deadline *at
that length*, where an under-estimate misses. `LengthCalibration` learns, from the
requests the proxy has finished, the distribution of true lengths for each range of
predictions (buckets of width `bucket_ratio` on a log scale) and returns its
`quantile`-th value: a length the request stays under with that probability, among
recent requests with a similar prediction. A bucket with fewer than `min_samples`
finished requests returns the prediction unchanged, so a new proxy starts as
Algorithm 1 and calibrates itself as traffic finishes (per replica, from its own
outcomes).

At a τ check the same samples answer how much further a stream is likely to run
(`remaining`): among the bucket's requests that ran past the stream's tokens so far,
the `quantile`-th of what they ran beyond it, a length distribution conditioned on
what the stream has already shown.

A new replica need not start blind: `prime` records a `LengthPrior` (the length
artifact's out-of-fold predictions and true lengths, carried on each prediction) as
if those requests had finished here, once per predictor key. They fill the buckets'
windows first, so the replica's own outcomes replace them as they come (after
`window` of its own in a bucket, none of the prior's is left there).

Quantiles are recomputed lazily: at most once per `refresh` new samples in a bucket,
so a routing decision reads a cached float.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import numpy.typing as npt

from proxy.types import LengthPrior

SURVIVORS_MIN = 10  # requests that ran past a stream's tokens, to read its remaining


class LengthCalibration:
    def __init__(self, quantile: float, window: int = 500, min_samples: int = 50,
                 bucket_ratio: float = 2.0, refresh: int = 16) -> None:
        if not 0 < quantile < 1:
            raise ValueError("quantile must be in (0, 1)")
        if bucket_ratio <= 1:
            raise ValueError("bucket_ratio must be > 1")
        self.quantile = quantile
        self.window = window
        self.min_samples = min_samples
        self._log_ratio = math.log(bucket_ratio)
        self._refresh = refresh
        self._samples: dict[int, deque[int]] = {}
        self._cached: dict[int, float] = {}  # bucket -> quantile of its samples
        self._stale: dict[int, int] = {}  # bucket -> samples since its quantile
        self._primed: set[str] = set()  # predictor keys whose prior is recorded

    def bucket(self, predicted: float) -> int:
        return int(math.log(max(predicted, 1.0)) // self._log_ratio)

    def record(self, predicted: float, actual: int) -> None:
        """A finished request: what it was predicted at and how many tokens it ran."""
        b = self.bucket(predicted)
        samples = self._samples.setdefault(b, deque(maxlen=self.window))
        samples.append(actual)
        self._stale[b] = self._stale.get(b, self._refresh) + 1

    def prime(self, prior: LengthPrior) -> bool:
        """Record the prior's samples, the first time this key's prior is seen (True)."""
        if prior.key in self._primed:
            return False
        self._primed.add(prior.key)
        for predicted, actual in prior.samples:
            self.record(predicted, actual)
        return True

    def adjust(self, predicted: float) -> float:
        """The `quantile`-th true length of recent requests predicted in the same
        bucket; the prediction itself while the bucket has too few samples."""
        b = self.bucket(predicted)
        samples = self._enough(b)
        if samples is None:
            return predicted
        if self._stale[b] >= self._refresh:  # a bucket's first sample makes it stale
            self._cached[b] = float(np.quantile(_array(samples), self.quantile))
            self._stale[b] = 0
        return self._cached[b]

    def remaining(self, predicted: float, generated: int) -> float | None:
        """For a stream predicted at `predicted` that has run `generated` tokens: the
        `quantile`-th of how much further the bucket's requests that ran past
        `generated` went (None while the bucket, or those, are too few)."""
        samples = self._enough(self.bucket(predicted))
        if samples is None:
            return None
        ran = _array(samples)
        left = ran[ran > generated] - generated
        if len(left) < SURVIVORS_MIN:
            return None
        return float(np.quantile(left, self.quantile))

    def _enough(self, b: int) -> deque[int] | None:
        """Bucket b's samples, once it has `min_samples` of them."""
        samples = self._samples.get(b)
        if samples is None or len(samples) < self.min_samples:
            return None
        return samples

    def counts(self) -> dict[int, int]:
        """Samples per bucket (bucket b holds predictions in [r^b, r^(b+1)))."""
        return {b: len(s) for b, s in sorted(self._samples.items())}


def _array(samples: deque[int]) -> npt.NDArray[np.float64]:
    return np.fromiter(samples, float, len(samples))
