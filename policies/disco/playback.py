"""DiSCo's token-level migration (§4.3): when to move a stream (Eq. 4-5), how many
tokens the reader must have buffered first (Eq. 6), and the reader's clock that tells
whether a move stalled them.

The reader consumes token i at p_i = max(a_i, p_{i-1} + 1/r_c): on arrival if they are
waiting for it, else one reading interval after the previous one. A token that makes
them wait (a_i > p_{i-1} + 1/r_c) is delayed, by that much stall. r_c = 0 is a machine
reader: it takes every token on arrival and never waits on its own pace.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from policies.disco.cost import TokenCost
from policies.disco.distributions import Floats


def should_migrate(source: TokenCost, target: TokenCost, remaining_tokens: float,
                   context_tokens: float) -> bool:
    """Eq. 4-5: the decode saving Δc·l_remaining must exceed the target's re-prefill of
    the prompt and the answer so far (no KV cache moves, §4.3). Only towards the
    cheaper decoder: Eq. 5's |Δc| would also move a stream to a dearer one."""
    saving = (source.decode - target.decode) * max(remaining_tokens, 0.0)
    return saving > 0.0 and saving > target.prefill * context_tokens


def buffer_target(read_rate: float, migration_s: float) -> float:
    """Eq. 6: B = r_c·t_m tokens the reader must hold before the source stops, so they
    read through the target's first-token time t_m. 0 for a machine reader."""
    return read_rate * migration_s if read_rate > 0.0 else 0.0


def consumption_times(arrivals: Floats, read_rate: float) -> Floats:
    """p_i for arrival times a_i (ascending along the last axis: one stream, or one
    stream per row). p_i - i/r_c is the running maximum of a_j - j/r_c, so the
    recurrence is one cumulative max."""
    if read_rate <= 0.0 or not arrivals.size:
        return arrivals.astype(np.float64)
    pace = np.arange(arrivals.shape[-1], dtype=np.float64) / read_rate
    read: Floats = np.maximum.accumulate(arrivals - pace, axis=-1) + pace
    return read


@dataclass(frozen=True, slots=True)
class Stalls:
    delayed_tokens: int  # tokens the reader waited for after the first
    stall_s: float  # total seconds the reader waited beyond their own pace
    gaps: Floats  # p_i - p_{i-1}: the time between tokens as the reader sees it


def stalls(arrivals: Floats, read_rate: float) -> Stalls:
    read = consumption_times(arrivals, read_rate)
    gaps = np.diff(read)
    if read_rate <= 0.0:
        return Stalls(0, 0.0, gaps)
    waits = gaps - 1.0 / read_rate
    late = waits > 1e-9
    return Stalls(int(late.sum()), float(waits[late].sum()), gaps)


class PlaybackClock:
    """Fed token arrival times one at a time (ascending): how much the reader has
    buffered at a moment, and the stalls so far."""

    def __init__(self, read_rate: float) -> None:
        self._interval = 1.0 / read_rate if read_rate > 0.0 else 0.0
        self._arrivals: list[float] = []
        self._reads: list[float] = []
        self.delayed_tokens = 0
        self.stall_s = 0.0

    def arrive(self, at: float) -> None:
        if self._reads:
            due = self._reads[-1] + self._interval
            if self._interval > 0.0 and at > due + 1e-9:
                self.delayed_tokens += 1
                self.stall_s += at - due
            self._reads.append(max(at, due))
        else:
            self._reads.append(at)
        self._arrivals.append(at)

    def buffered(self, now: float) -> int:
        """Tokens arrived by `now` that the reader has not read yet."""
        arrived = bisect.bisect_right(self._arrivals, now)
        read = bisect.bisect_right(self._reads, now)
        return arrived - read
