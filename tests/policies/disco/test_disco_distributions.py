"""The learned distributions: Kaplan-Meier F, its quantiles, the device's TTFT line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from policies.disco.distributions import (
    DeviceFit,
    DeviceLine,
    LengthWindow,
    TtftWindow,
    kaplan_meier,
    read_prior,
)


def test_kaplan_meier_by_hand() -> None:
    # 1 (event), 2 (event), 2 (censored), 3 (event), 4 (censored), 5 (event):
    # S(1) = 5/6, S(2) = 5/6·4/5, S(3) = 2/3·2/3 (3 at risk), S(5) = 0 (1 at risk)
    times = np.array([3.0, 2.0, 1.0, 5.0, 2.0, 4.0])
    censored = np.array([False, True, False, False, False, True])
    ecdf = kaplan_meier(times, censored)
    assert list(ecdf.times) == [1.0, 2.0, 3.0, 5.0]
    assert ecdf.cdf == pytest.approx([1 / 6, 1 / 3, 5 / 9, 1.0])
    assert ecdf.at(0.5) == 0.0 and ecdf.at(4.5) == pytest.approx(5 / 9)
    assert ecdf.quantile(0.5) == 3.0 and ecdf.quantile(0.56) == 5.0


def test_kaplan_meier_without_censoring_is_the_empirical_cdf() -> None:
    draws = np.random.default_rng(3).lognormal(0.0, 1.0, 999)
    ecdf = kaplan_meier(draws, np.zeros(len(draws), dtype=bool))
    for t in np.quantile(draws, np.linspace(0, 1, 41)):
        assert ecdf.at(float(t)) == pytest.approx(float((draws <= t).mean()), abs=1e-12)
    assert ecdf.quantile(0.5) == pytest.approx(np.quantile(draws, 0.5, method="inverted_cdf"))


def test_censoring_moves_mass_to_the_tail_instead_of_dropping_it() -> None:
    events = np.array([0.1, 0.2, 0.3, 0.4])
    slow = np.array([0.25, 0.25, 0.25, 0.25])  # aborted legs: TTFT beyond 0.25 s
    times = np.concatenate([events, slow])
    censored = np.array([False] * 4 + [True] * 4)
    ecdf = kaplan_meier(times, censored)
    dropped = kaplan_meier(events, np.zeros(4, dtype=bool))
    assert ecdf.at(0.2) == pytest.approx(2 / 8)  # before the censoring, as if uncensored
    assert ecdf.at(0.3) < dropped.at(0.3)
    assert ecdf.quantile(0.99) == 0.4  # the last event closes the curve
    only_censored_tail = kaplan_meier(np.array([0.1, 0.9]), np.array([False, True]))
    assert only_censored_tail.quantile(0.99) == 0.9  # F stops at 1/2: the largest sample


def test_the_windows_keep_the_latest_samples_and_skip_junk(tmp_path: Path) -> None:
    prior = tmp_path / "ttft.json"
    prior.write_text(json.dumps([0.5, 0.6, 0.7]))
    window = TtftWindow(3, read_prior(prior))
    window.add(float("nan"))
    window.add(-1.0)
    window.add(2.0, censored=True)
    assert len(window) == 3
    assert window.ecdf().largest == 2.0 and list(window.ecdf().times) == [0.6, 0.7]
    lengths = LengthWindow(2)
    for tokens in (5.0, 3.0, 1.0):
        lengths.add(tokens)
    assert list(lengths.sorted()) == [1.0, 3.0]
    prior.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="JSON list"):
        read_prior(prior)


def test_device_line_is_recovered_by_least_squares() -> None:
    fit = DeviceFit(500, DeviceLine(0.1, 0.0))
    assert fit.line() == DeviceLine(0.1, 0.0)  # the prior until samples spread
    rng = np.random.default_rng(4)
    for tokens in rng.integers(5, 400, 300):
        fit.add(float(tokens), 0.032 * float(tokens) + 0.21)
    line = fit.line()
    assert line.k == pytest.approx(0.032, rel=1e-9) and line.c == pytest.approx(0.21, rel=1e-9)
    assert line.ttft(100.0) == pytest.approx(3.41)
