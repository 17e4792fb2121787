"""Passive health: take a backend out while it fails what it is sent, though it still
answers its scrapes (Envoy's outlier detection, LiteLLM's cooldowns).

The poller sees a backend whose HTTP server is up. It does not see one whose every
generation fails: a 5xx, a stream that breaks or stalls, an abort. The proxy retries
each such attempt elsewhere or continues it by migration, so nothing is lost, but
every request the policy sends there pays a failed attempt first, and a policy that
counts open requests (least_request) prefers a backend that fails fast.

Each backend's attempts (requests sent to it) and failures (`count_upstream_error`: a
timeout or stall, a 5xx, a broken or malformed stream, an error event; not a refused
connection, which the poller already acts on and which costs a retry nothing; never a
refusal of the request, which is the client's error) are counted over the last
`window_s`, in ten slices. A failure that makes at least `failures` of them in the
window, and at least `failure_ratio` of its attempts there, ejects the backend: it is
unhealthy for `eject_s`, doubled for each ejection that follows within `max_eject_s`
of the end of the one before, up to `max_eject_s`. Then its next good scrape brings it
back, with a fresh count. At most `max_ejection_percent` of the backends of a model are
out at once (one always may be): a backend that reaches the count while they are stays
in, its count kept, until one comes back. Requests that fail on every backend (a prompt
that crashes vLLM, sent again and again) count against all of them, and without that
bound would take every one out; when every backend of a model is out, panic mode
(`poller.route_when_all_unhealthy`) routes among them all again.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from proxy.config import OutliersConfig

log = logging.getLogger("laneway.outliers")

SLICES = 10  # a window is counted in this many slices


@dataclass(slots=True)
class _Record:
    slices: deque[list[int]] = field(default_factory=deque)  # [slice, attempts, failures]
    streak: int = 0  # ejections, each within max_eject_s of the end of the one before
    back_at: float = -math.inf  # when the last ejection ends
    held: bool = False  # due for ejection, kept in by max_ejection_percent (logged once)


class Outliers:
    def __init__(self, cfg: Callable[[], OutliersConfig],
                 eject: Callable[[str, float], None],
                 peers: Callable[[str], Sequence[str]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`cfg`: the current settings (they change on reload); `eject(backend, for_s)`
        takes a backend out (the poller's); `peers(backend)`: the backends of its model,
        itself among them."""
        self._cfg = cfg
        self._eject = eject
        self._peers = peers
        self._clock = clock
        self._records: dict[str, _Record] = {}
        self.ejections = 0  # since start

    def sent(self, backend: str) -> None:
        """A request went to `backend`."""
        cfg = self._cfg()
        if cfg.failures:
            self._slice(backend, cfg.window_s)[1] += 1

    def failed(self, backend: str, kind: str) -> None:
        """An attempt on `backend` failed (`kind` as in `laneway_upstream_errors_total`)."""
        cfg = self._cfg()
        if not cfg.failures or kind == "connect":
            return
        now = self._clock()
        record = self._records.get(backend)
        if record is not None and now < record.back_at:
            return  # out already: what it had open is failing over
        self._slice(backend, cfg.window_s)[2] += 1
        record = self._records[backend]
        attempts = sum(s[1] for s in record.slices)
        failures = sum(s[2] for s in record.slices)
        if failures < cfg.failures or failures < cfg.failure_ratio * max(attempts, failures):
            record.held = False
            return
        if self._at_the_bound(backend, record, cfg):
            return
        record.held = False
        record.streak = record.streak + 1 if now - record.back_at <= cfg.max_eject_s else 0
        for_s = min(cfg.eject_s * 2.0 ** min(record.streak, 64), cfg.max_eject_s)
        record.back_at = now + for_s
        record.slices.clear()
        self.ejections += 1
        why = (f"{failures} of its {max(attempts, failures)} attempts in the last "
               f"{cfg.window_s:g} s failed (the last: {kind})")
        log.warning("backend %s ejected for %.0f s: %s", backend, for_s, why)
        self._eject(backend, for_s)

    def _at_the_bound(self, backend: str, record: _Record, cfg: OutliersConfig) -> bool:
        """Whether ejecting `backend` would put more of its model's backends out than
        `max_ejection_percent` allows (logged once while it stays so)."""
        peers = self._peers(backend)
        out = [p for p in peers if p != backend and self.ejected_for(p) > 0]
        allowed = max(1, math.floor(cfg.max_ejection_percent / 100 * len(peers)))
        if len(out) < allowed:
            return False
        if not record.held:
            record.held = True
            log.warning("backend %s not ejected, though it fails: %d of the %d backends of "
                        "its model are out already (%s; outliers.max_ejection_percent %g)",
                        backend, len(out), len(peers), ", ".join(sorted(out)),
                        cfg.max_ejection_percent)
        return True

    def ejected_for(self, backend: str) -> float:
        """Seconds until `backend`'s ejection ends (0: not ejected)."""
        record = self._records.get(backend)
        return 0.0 if record is None else max(0.0, record.back_at - self._clock())

    def forget(self, backend: str) -> None:
        """Start `backend` afresh: it was removed from the fleet, or an operator ended
        its ejection (undrain)."""
        self._records.pop(backend, None)

    def _slice(self, backend: str, window_s: float) -> list[int]:
        """The current slice of `backend`'s window, the slices older than it dropped."""
        record = self._records.get(backend)
        if record is None:
            record = self._records[backend] = _Record()
        number = int(self._clock() * SLICES / window_s)
        slices = record.slices
        if slices and slices[-1][0] > number:  # (window_s shortened by a reload)
            slices.clear()
        if not slices or slices[-1][0] != number:
            while slices and slices[0][0] <= number - SLICES:
                slices.popleft()
            slices.append([number, 0, 0])
        return slices[-1]
