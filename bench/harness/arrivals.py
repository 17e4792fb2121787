"""Seeded arrival processes: offsets in seconds from the start of a run.

* Poisson at rate λ: exponential gaps with mean 1/λ.
* Gamma at rate λ with coefficient of variation `cv`: gaps ~ Gamma(k = 1/cv²,
  θ = 1/(λk)), so the mean rate stays λ; cv > 1 is burstier than Poisson, cv = 1 is
  Poisson, cv < 1 is smoother.
* On-off: Poisson at λ during `on_s` windows separated by silent `off_s` windows;
  the long-run rate is λ·on/(on+off).

Every process stops at `n` arrivals or at `duration_s`, whichever comes first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Arrivals:
    process: str  # "poisson", "gamma" or "onoff"
    rate: float  # λ, requests per second (during "on" windows for on-off)
    cv: float = 1.0  # gamma only
    on_s: float = 10.0  # on-off only
    off_s: float = 10.0  # on-off only

    def offsets(self, n: int, duration_s: float | None, seed: int) -> list[float]:
        if self.rate <= 0:
            raise ValueError("arrival rate must be positive")
        rng = np.random.default_rng(seed)
        if self.process == "poisson":
            gaps = rng.exponential(1.0 / self.rate, n)
        elif self.process == "gamma":
            shape = 1.0 / self.cv**2
            gaps = rng.gamma(shape, 1.0 / (self.rate * shape), n)
        elif self.process == "onoff":
            gaps = rng.exponential(1.0 / self.rate, n)
        else:
            raise ValueError(f"unknown arrival process {self.process!r}")
        # The first request starts the run; later ones follow the gaps.
        times = np.concatenate(([0.0], np.cumsum(gaps[1:])))
        if self.process == "onoff":
            times = _spread_over_on_windows(times, self.on_s, self.off_s)
        if duration_s is not None:
            times = times[times <= duration_s]
        return [float(t) for t in times]

    @property
    def mean_rate(self) -> float:
        if self.process == "onoff":
            return self.rate * self.on_s / (self.on_s + self.off_s)
        return self.rate


def _spread_over_on_windows(on_time: np.ndarray, on_s: float, off_s: float) -> np.ndarray:
    """Map times measured in "on" seconds to wall time with an off window after each."""
    windows_before = np.floor(on_time / on_s)
    result: np.ndarray = on_time + windows_before * off_s
    return result
