"""LengthCalibration: the quantile of true lengths among requests predicted alike."""

from __future__ import annotations

import pytest

from predictors.length.calibration import LengthCalibration
from proxy.types import LengthPrior


def test_a_bucket_routes_on_the_prediction_until_it_has_enough_samples() -> None:
    cal = LengthCalibration(0.8, min_samples=5, refresh=1)
    for _ in range(4):
        cal.record(100, 400)
    assert cal.adjust(100) == 100  # four samples: not yet
    cal.record(100, 400)
    assert cal.adjust(100) == 400


def test_quantile_is_of_the_true_lengths_in_the_predictions_bucket() -> None:
    cal = LengthCalibration(0.8, min_samples=10, refresh=1)
    for actual in range(1, 101):  # predicted ~100 (bucket [64, 128)): ran 1..100 tokens
        cal.record(90 + actual % 20, actual)
    for actual in range(1000, 1100):  # predicted ~600 (bucket [512, 1024)): ran 1000+
        cal.record(600, actual)
    assert cal.adjust(100) == pytest.approx(80.2)  # numpy's linear 0.8 quantile of 1..100
    assert cal.adjust(70) == pytest.approx(80.2)  # same bucket
    assert cal.adjust(700) == pytest.approx(1079.2)
    assert cal.adjust(300) == 300  # bucket [256, 512): no samples
    assert cal.counts() == {6: 100, 9: 100}


def test_window_forgets_old_samples_and_the_cache_refreshes() -> None:
    cal = LengthCalibration(0.5, window=10, min_samples=10, refresh=4)
    for _ in range(10):
        cal.record(100, 50)
    assert cal.adjust(100) == 50
    for _ in range(3):
        cal.record(100, 500)
    assert cal.adjust(100) == 50  # three new samples: the cached quantile stands
    for _ in range(7):
        cal.record(100, 500)
    assert cal.adjust(100) == 500  # the window now holds only the new samples


@pytest.mark.parametrize("kwargs", [{"quantile": 0.0}, {"quantile": 1.0},
                                    {"quantile": 0.5, "bucket_ratio": 1.0}])
def test_bad_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LengthCalibration(**kwargs)  # type: ignore[arg-type]


def test_remaining_is_conditioned_on_what_the_stream_has_run() -> None:
    cal = LengthCalibration(0.5, min_samples=20)
    for actual in range(10, 210, 10):  # predicted 100: ran 10, 20, ..., 200
        cal.record(100, actual)
    assert cal.remaining(100, 0) == pytest.approx(105)  # the median of all 20
    assert cal.remaining(100, 100) == pytest.approx(55)  # of 110..200, past 100
    assert cal.remaining(100, 105) == pytest.approx(50)
    assert cal.remaining(100, 110) is None  # nine ran further: too few to say
    assert cal.remaining(400, 0) is None  # no samples in that bucket


def test_a_prior_calibrates_from_the_first_request_once_per_key_then_gives_way() -> None:
    cal = LengthCalibration(0.5, window=20, min_samples=10, refresh=1)
    prior = LengthPrior("m", tuple((100.0, 400) for _ in range(20)))
    assert cal.adjust(100) == 100  # nothing seen: the prediction
    assert cal.prime(prior)
    assert cal.adjust(100) == 400  # before any request finished here
    assert not cal.prime(prior)  # the same key's prior again: not recorded twice
    assert cal.counts() == {6: 20}
    assert cal.prime(LengthPrior("other", ((1000.0, 50),)))  # another key's is its own
    for _ in range(20):  # the replica's own outcomes fill the window
        cal.record(100, 150)
    assert cal.adjust(100) == 150
