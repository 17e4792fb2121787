"""What DiSCo learns online: the server's TTFT distribution F, the prompt lengths p(l)
and the device's TTFT line T_d(l) = k·l + c, each over a window of recent samples.

F is a Kaplan-Meier estimate: a server leg that lost the race was aborted before its
first token, so all we know is that its TTFT exceeds the time it ran (a censored
sample). Dropping those would bias F towards fast servers exactly when the device
wins, i.e. when the server is slow.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Ecdf:
    """A step CDF: F(t) = `cdf[j]` for `times[j]` <= t < `times[j+1]`, 0 before."""

    times: Floats  # distinct event times, ascending
    cdf: Floats  # F at each of them, non-decreasing
    largest: float  # the largest observation, event or censored

    @classmethod
    def empty(cls) -> Ecdf:
        return cls(np.zeros(0), np.zeros(0), 0.0)

    def __len__(self) -> int:
        return len(self.times)

    def at(self, t: float) -> float:
        j = int(np.searchsorted(self.times, t, side="right")) - 1
        return float(self.cdf[j]) if j >= 0 else 0.0

    def survival(self, t: float) -> float:
        return 1.0 - self.at(t)

    def quantile(self, q: float) -> float:
        """F⁻¹(q): the smallest t with F(t) >= q. When censoring leaves F below q
        everywhere, the largest observation (the tail is known only to lie beyond it)."""
        if q <= 0.0 or not len(self.times):
            return 0.0
        j = int(np.searchsorted(self.cdf, q - 1e-12, side="left"))
        return float(self.times[j]) if j < len(self.times) else self.largest


def kaplan_meier(times: Floats, censored: npt.NDArray[np.bool_]) -> Ecdf:
    """F = 1 - S with S(t) = Π_{t_j <= t} (1 - d_j / n_j): d_j events at t_j, n_j
    samples at risk (time >= t_j; a sample censored at t_j counts as at risk there)."""
    if not len(times):
        return Ecdf.empty()
    ordered = np.sort(times)
    event_times, deaths = np.unique(times[~censored], return_counts=True)
    at_risk = len(times) - np.searchsorted(ordered, event_times, side="left")
    survival = np.cumprod(1.0 - deaths / at_risk)
    cdf: Floats = np.asarray(1.0 - survival, dtype=np.float64)
    return Ecdf(event_times.astype(np.float64), cdf, float(ordered[-1]))


class TtftWindow:
    """The last `size` server TTFTs, each an event or censored; primed from a prior."""

    def __init__(self, size: int, prior: list[float] | None = None) -> None:
        self._seconds: deque[float] = deque(maxlen=size)
        self._censored: deque[bool] = deque(maxlen=size)
        for seconds in prior or ():
            self.add(seconds)

    def __len__(self) -> int:
        return len(self._seconds)

    def add(self, seconds: float, censored: bool = False) -> None:
        if math.isfinite(seconds) and seconds >= 0.0:
            self._seconds.append(seconds)
            self._censored.append(censored)

    def ecdf(self) -> Ecdf:
        n = len(self._seconds)
        if not n:
            return Ecdf.empty()
        return kaplan_meier(np.fromiter(self._seconds, dtype=np.float64, count=n),
                            np.fromiter(self._censored, dtype=bool, count=n))


def read_prior(path: str | Path) -> list[float]:
    """A TTFT prior file: a JSON list of seconds."""
    values = json.loads(Path(path).read_text())
    if not isinstance(values, list) or not all(isinstance(v, int | float) for v in values):
        raise ValueError(f"{path}: expected a JSON list of seconds")
    return [float(v) for v in values]


class LengthWindow:
    """The last `size` prompt lengths (tokens): the empirical p(l)."""

    def __init__(self, size: int) -> None:
        self._lengths: deque[float] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self._lengths)

    def add(self, tokens: float) -> None:
        if math.isfinite(tokens) and tokens >= 0.0:
            self._lengths.append(tokens)

    def sorted(self) -> Floats:
        return np.sort(np.fromiter(self._lengths, dtype=np.float64, count=len(self._lengths)))


@dataclass(frozen=True, slots=True)
class DeviceLine:
    """T_d(l) = k·l + c seconds."""

    k: float
    c: float

    def ttft(self, prompt_tokens: float) -> float:
        return self.k * prompt_tokens + self.c


class DeviceFit:
    """Least squares of the device's TTFT on prompt length over a window; `prior`
    until the window's lengths spread (two distinct lengths at least)."""

    def __init__(self, size: int, prior: DeviceLine) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=size)
        self._prior = prior

    def add(self, prompt_tokens: float, ttft_s: float) -> None:
        if math.isfinite(prompt_tokens) and math.isfinite(ttft_s) and ttft_s >= 0.0:
            self._samples.append((prompt_tokens, ttft_s))

    def line(self) -> DeviceLine:
        if len(self._samples) < 2:
            return self._prior
        x, y = (np.asarray(v, dtype=np.float64) for v in zip(*self._samples, strict=True))
        spread = float(np.var(x))
        if spread <= 0.0:
            return self._prior
        k = float(np.mean((x - x.mean()) * (y - y.mean())) / spread)
        return DeviceLine(max(k, 0.0), float(y.mean() - max(k, 0.0) * x.mean()))
