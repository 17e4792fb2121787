"""GoodServe's EMA-smoothed, black-box speed model of each backend (§3.3).

Per backend g: q_g (seconds a request waits in the queue), p_g (prefill seconds per
prompt token actually computed) and d_g (seconds per output token). Each is an
exponential moving average `x ← alpha*sample + (1 - alpha)*x` of what the backend was seen
doing recently, without modelling batch sizes or GPU types:

* every new poller snapshot of the backend's vLLM histograms gives one sample of each
  (interval means of `request_queue_time`, `request_prefill_time` over computed
  prefill tokens, and `inter_token_latency`), so a new backend starts with an estimate;
* every stream the proxy finishes on g gives one more sample of d_g (its mean TPOT as
  the proxy saw it), and with goodput's `stream_samples` so does every τ-token check
  of a running stream (the TPOT of the tokens since its previous check).

`capability(g)` is the lowest d_g the EMA has reached on real samples: what g does
when lightly loaded, its hardware speed as far as a black box can tell (goodput's
`selection: capability`).

`tpot_at(g, n)` (goodput's `speed_at_load`, a deviation) is d_g with n requests
running: a line through the snapshots' (running requests, interval TPOT) pairs, fitted
by EMA moments with its own slower weight (`LoadFit`), so that routing can see the
slowdown a request will meet, and cause, on a batch it joins, which the EMA of recent
samples sees only after it has happened. The fits are kept only when asked for
(`load_alpha`) and are this replica's own: they are not part of the replicated `Speed`.

`columns(candidates, stats)` gives q, p and d of a candidate tuple as numpy arrays
(with any newer snapshot folded in first), so that Eq. 2 over 512 backends is a few
array operations rather than a Python loop. The arrays mirror the `Speed` objects, which
stay the model's record: every change to one is written through (`_store`). A
candidate tuple's positions are cached by identity (the registry hands out the same
tuple until membership or health changes), and the snapshot check is skipped while the
stats mapping is the one already checked (the registry replaces it on every update).

Replicas share their estimates (proxy/state): each one's changed estimates are
averaged into the others' (`blend`), so every replica's EMA also reflects what the
others saw, and repeated exchanges bring them to one value.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter

import numpy as np
import numpy.typing as npt

from proxy.types import UNKNOWN_STATS, Backend, BackendStats

Floats = npt.NDArray[np.float64]
COLUMN_TUPLES = 32  # candidate tuples whose positions are cached (least recently used out)
_NAME = attrgetter("name")
_UPDATED_AT = attrgetter("updated_at")


@dataclass(slots=True)
class LoadFit:
    """TPOT against running requests, d ≈ mean_d + slope·(n - mean_n), from EMA
    moments of the (n, d) samples. The slope is 0 until the samples' running counts
    spread by at least one request (a standard deviation of 0.5) and never negative:
    a backend does not get faster by taking more work."""

    weight: float
    samples: int = 0
    mean_n: float = 0.0
    mean_d: float = 0.0
    mean_nn: float = 0.0
    mean_nd: float = 0.0

    def add(self, n: float, d: float) -> None:
        w = 1.0 if self.samples == 0 else self.weight
        self.samples += 1
        self.mean_n += w * (n - self.mean_n)
        self.mean_d += w * (d - self.mean_d)
        self.mean_nn += w * (n * n - self.mean_nn)
        self.mean_nd += w * (n * d - self.mean_nd)

    def slope(self) -> float:
        var = self.mean_nn - self.mean_n ** 2
        if var < 0.25:
            return 0.0
        return max(0.0, (self.mean_nd - self.mean_n * self.mean_d) / var)

    def at(self, n: float) -> float:
        return max(0.0, self.mean_d + self.slope() * (n - self.mean_n))


@dataclass(slots=True)
class Speed:
    queue_s: float
    prefill_s_per_token: float
    tpot_s: float
    seen_at: float = -1.0  # `updated_at` of the last snapshot folded in
    best_tpot_s: float | None = None  # lowest tpot_s after a real sample (capability)

    def set_tpot(self, tpot_s: float) -> None:
        self.tpot_s = tpot_s
        if self.best_tpot_s is None or tpot_s < self.best_tpot_s:
            self.best_tpot_s = tpot_s


@dataclass(slots=True)
class Columns:
    """Where one candidate tuple's backends sit in the model's arrays."""

    candidates: tuple[Backend, ...]
    names: tuple[str, ...]
    index: npt.NDArray[np.intp]
    stats: Mapping[str, BackendStats] | None = None  # the last one checked
    _position: dict[str, int] | None = None

    def position(self, name: str) -> int | None:
        """Where `name` is in `candidates` (None: not a candidate)."""
        if self._position is None:
            self._position = {name: i for i, name in enumerate(self.names)}
        return self._position.get(name)


class SpeedModel:
    def __init__(self, alpha: float, default: Speed, load_alpha: float | None = None,
                 load_min_samples: int = 10) -> None:
        """`load_alpha`: fit TPOT against running requests per backend with this EMA
        weight (`tpot_at`); None: no fits."""
        self._alpha = alpha
        self._default = default
        self._load_alpha = load_alpha
        self._load_min_samples = load_min_samples
        self._speeds: dict[str, Speed] = {}
        self._loads: dict[str, LoadFit] = {}
        self.changed: set[str] = set()  # backends whose estimate changed here (replication)
        # rows q, p, d and seen_at; a column per backend with an estimate (its slot)
        self._slots: dict[str, int] = {}
        self._table: Floats = np.zeros((4, 0))
        self._columns: OrderedDict[int, Columns] = OrderedDict()

    def of(self, name: str, stats: BackendStats) -> Speed:
        """The backend's estimate, first folding in a snapshot it has not seen."""
        speed = self._speeds.get(name)
        if speed is None:
            d = self._default
            speed = self._speeds[name] = Speed(
                _or(stats.queue_s, d.queue_s), _or(stats.prefill_s_per_token,
                                                   d.prefill_s_per_token),
                _or(stats.tpot_s, d.tpot_s), stats.updated_at, best_tpot_s=stats.tpot_s)
            self._fit_load(name, stats)
            self._store(name, speed)
            self.changed.add(name)
        elif stats.updated_at > speed.seen_at:
            speed.seen_at = stats.updated_at
            a = self._alpha
            if stats.queue_s is not None:
                speed.queue_s = a * stats.queue_s + (1 - a) * speed.queue_s
            if stats.prefill_s_per_token is not None:
                speed.prefill_s_per_token = (a * stats.prefill_s_per_token
                                             + (1 - a) * speed.prefill_s_per_token)
            if stats.tpot_s is not None:
                speed.set_tpot(a * stats.tpot_s + (1 - a) * speed.tpot_s)
            self._fit_load(name, stats)
            self._store(name, speed)
            self.changed.add(name)
        return speed

    def columns(self, candidates: tuple[Backend, ...], stats: Mapping[str, BackendStats]
                ) -> tuple[Columns, Floats, Floats, Floats]:
        """q, p and d of every candidate, in the candidates' order, after folding in
        the snapshots newer than their estimates (`of` for each, as arrays): this runs
        over every candidate of every goodput decision."""
        cols = self._columns.get(id(candidates))
        if cols is None or cols.candidates is not candidates:
            cols = self._index(candidates, stats)
        else:
            self._columns.move_to_end(id(candidates))  # kept over retries' one-off tuples
        if cols.stats is not stats:
            names = cols.names
            updated = np.fromiter(map(_UPDATED_AT, map(stats.get, names, repeat(UNKNOWN_STATS))),
                                  np.float64, len(names))
            for i in np.flatnonzero(updated > self._table[3, cols.index]).tolist():
                self.of(names[i], stats[names[i]])
            cols.stats = stats
        queue, prefill, tpot, _ = self._table[:, cols.index]
        return cols, queue, prefill, tpot

    def _index(self, candidates: tuple[Backend, ...], stats: Mapping[str, BackendStats]
               ) -> Columns:
        names = tuple(map(_NAME, candidates))
        slots = self._slots
        for name in names:
            if name not in slots:
                self.of(name, stats.get(name, UNKNOWN_STATS))
        cols = Columns(candidates, names,
                       np.fromiter(map(slots.__getitem__, names), np.intp, len(names)))
        self._columns[id(candidates)] = cols
        while len(self._columns) > COLUMN_TUPLES:
            self._columns.popitem(last=False)
        return cols

    def _store(self, name: str, speed: Speed) -> None:
        """Write `name`'s estimate through to the arrays."""
        slot = self._slots.get(name)
        if slot is None:
            slot = self._slots[name] = len(self._slots)
            width = self._table.shape[1]
            if slot >= width:
                grown = np.zeros((4, max(64, 2 * width)))
                grown[:, :width] = self._table
                self._table = grown
        self._table[:, slot] = (speed.queue_s, speed.prefill_s_per_token, speed.tpot_s,
                                speed.seen_at)

    def tpot_at(self, name: str, running: float) -> float | None:
        """g's d with `running` requests in its batch, from the load fit; None until
        it has `load_min_samples` snapshots with a TPOT (or fits are off)."""
        fit = self._loads.get(name)
        if fit is None or fit.samples < self._load_min_samples:
            return None
        return fit.at(running)

    def _fit_load(self, name: str, stats: BackendStats) -> None:
        if self._load_alpha is not None and stats.tpot_s is not None:
            fit = self._loads.setdefault(name, LoadFit(self._load_alpha))
            fit.add(stats.running, stats.tpot_s)

    def observe_tpot(self, name: str, tpot_s: float) -> None:
        speed = self._speeds.get(name)
        if speed is not None:
            speed.set_tpot(self._alpha * tpot_s + (1 - self._alpha) * speed.tpot_s)
            self._store(name, speed)
            self.changed.add(name)

    def peek(self, name: str) -> Speed | None:
        return self._speeds.get(name)

    def capability(self, name: str) -> float | None:
        """g's lightly loaded d_g (None before its estimate exists)."""
        speed = self._speeds.get(name)
        if speed is None:
            return None
        return speed.tpot_s if speed.best_tpot_s is None else speed.best_tpot_s

    def blend(self, name: str, queue_s: float, prefill_s_per_token: float,
              tpot_s: float) -> None:
        """Average another replica's estimate of `name` into this one."""
        speed = self._speeds.get(name)
        if speed is None:
            speed = self._speeds[name] = Speed(queue_s, prefill_s_per_token, tpot_s,
                                               best_tpot_s=tpot_s)
        else:
            speed.queue_s = (speed.queue_s + queue_s) / 2
            speed.prefill_s_per_token = (speed.prefill_s_per_token + prefill_s_per_token) / 2
            speed.set_tpot((speed.tpot_s + tpot_s) / 2)
        self._store(name, speed)


def _or(value: float | None, default: float) -> float:
    return default if value is None else value
