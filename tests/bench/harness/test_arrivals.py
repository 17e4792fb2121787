"""Arrival processes: seeded, at the asked rate, with the asked burstiness."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from bench.harness.arrivals import Arrivals


def gaps(times: list[float]) -> np.ndarray:
    return np.diff(np.asarray(times))


def test_same_seed_same_arrivals_other_seed_other_arrivals() -> None:
    process = Arrivals("poisson", 3.0)
    assert process.offsets(50, None, seed=7) == process.offsets(50, None, seed=7)
    assert process.offsets(50, None, seed=7) != process.offsets(50, None, seed=8)


def test_poisson_rate_and_exponential_gaps() -> None:
    times = Arrivals("poisson", 5.0).offsets(5000, None, seed=1)
    assert times[0] == 0.0 and all(b >= a for a, b in pairwise(times))
    rate = (len(times) - 1) / times[-1]
    assert rate == pytest.approx(5.0, rel=0.05)
    assert gaps(times).std() / gaps(times).mean() == pytest.approx(1.0, abs=0.06)  # CV 1


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_keeps_the_rate_and_sets_the_burstiness(cv: float) -> None:
    times = Arrivals("gamma", 4.0, cv=cv).offsets(8000, None, seed=2)
    assert (len(times) - 1) / times[-1] == pytest.approx(4.0, rel=0.08)
    assert gaps(times).std() / gaps(times).mean() == pytest.approx(cv, rel=0.1)


def test_on_off_is_silent_in_off_windows_and_has_the_duty_cycle_rate() -> None:
    process = Arrivals("onoff", 10.0, on_s=2.0, off_s=3.0)
    times = np.asarray(process.offsets(4000, None, seed=3))
    assert np.all(times % 5.0 < 2.0)  # every arrival falls in an on window
    assert (len(times) - 1) / times[-1] == pytest.approx(process.mean_rate, rel=0.06)
    assert process.mean_rate == pytest.approx(4.0)


def test_duration_bounds_the_arrivals() -> None:
    times = Arrivals("poisson", 10.0).offsets(1000, 2.0, seed=4)
    assert max(times) <= 2.0
    assert 10 < len(times) < 40  # ~20 expected
    assert times == Arrivals("poisson", 10.0).offsets(1000, None, seed=4)[:len(times)]


def test_bad_process_or_rate_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown arrival process"):
        Arrivals("uniform", 1.0).offsets(3, None, 0)
    with pytest.raises(ValueError, match="positive"):
        Arrivals("poisson", 0.0).offsets(3, None, 0)
