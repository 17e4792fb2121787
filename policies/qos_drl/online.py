"""What qos_drl remembers between decisions: the requests it routed (the request nodes
of its state graph, and the running queues of Eq. 15) and, when learning online, the
pending transition whose reward the next decision completes (Eq. 16)."""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from policies.qos_drl.impact import Coefficients, RunningRequest, impact, reward
from policies.qos_drl.replay import Replay
from policies.qos_drl.sac import ActingCopy, SacAgent
from policies.qos_drl.state import GraphState, RequestFeatures
from proxy.types import Backend, BackendStats, ClusterView

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Routed:
    backend: str
    prompt_tokens: int
    score: float  # predicted on the chosen expert
    length: float
    started: float  # monotonic seconds


class InflightBook:
    """Requests this policy routed and has not seen finish, per backend."""

    def __init__(self, limit_s: float, default_tpot_s: float) -> None:
        self.limit_s, self.default_tpot_s = limit_s, default_tpot_s
        self._routed: dict[str, Routed] = {}

    def routed(self, request_id: str, backend: Backend, prompt_tokens: int, score: float,
               length: float, now: float) -> None:
        self._routed[request_id] = Routed(backend.name, prompt_tokens, score, length, now)

    def finished(self, request_id: str) -> Routed | None:
        return self._routed.pop(request_id, None)

    def requests(self, backend: str, stats: BackendStats, now: float
                 ) -> tuple[list[RequestFeatures], list[RequestFeatures]]:
        """(running, waiting) request features, newest first; the oldest `running`
        requests are taken as running (vLLM serves in arrival order)."""
        tpot = stats.tpot_s or self.default_tpot_s
        mine = sorted((r for r in self._routed.values() if r.backend == backend),
                      key=lambda r: r.started)
        running_n = stats.running if stats.updated_at else len(mine)
        features = []
        for r in mine:
            elapsed = now - r.started
            generated = int(min(r.length, elapsed / tpot)) if r.length else int(elapsed / tpot)
            memory = stats.kv_usage / max(1, stats.running)
            features.append(RequestFeatures(r.prompt_tokens, r.score, r.length, memory,
                                            generated, elapsed / max(1, generated)))
        return features[:running_n][::-1], features[running_n:][::-1]

    def running_requests(self, backend: str, stats: BackendStats, now: float
                         ) -> list[RunningRequest]:
        running, _ = self.requests(backend, stats, now)
        return [RunningRequest(f.prompt_tokens, max(1, int(f.length)), f.generated,
                               f.latency_per_token, f.score) for f in running]

    def impact(self, backend: Backend | None, prompt_tokens: int, length: float,
               k: Coefficients | None, view: ClusterView) -> float:
        """Eq. 15's QoS at risk on `backend` if this request joins it (0 for a drop)."""
        if backend is None or k is None:
            return 0.0
        running = self.running_requests(backend.name, view.stats_of(backend), view.now)
        return impact(k, running, prompt_tokens, max(1, int(length)), self.limit_s)


class OnlineLearner:
    """Turns (decision, completions since, next decision) into SAC transitions, and trains
    the agent on them: one update per stored transition once `warmup` are stored, as the
    simulator trains.

    A SAC update of the HAN agent takes ~20-25 ms of CPU, which in the decision would
    stall the proxy's event loop, and every stream it relays, that long per request. So
    by default (`background`) the updates run in a thread of their own on the agent, and
    decisions act on `acting`, a copy of its encoder and actor that the thread replaces
    after each update (a reference swap: a decision never sees half-updated weights).
    Updates the thread has not got to are owed, at most `MAX_OWED`; further ones are
    skipped (counted in `skipped`), so a burst never leaves it training long after.
    `on_report(self)` runs in the learning thread every `report_every` updates.
    """

    MAX_OWED = 100

    def __init__(self, agent: SacAgent, warmup: int, batch: int, *, background: bool = True,
                 report_every: int = 100,
                 on_report: Callable[[OnlineLearner], None] | None = None) -> None:
        self.agent, self.warmup, self.batch = agent, warmup, batch
        self.acting = ActingCopy(agent)
        self.report_every, self.on_report = report_every, on_report
        self.replay: Replay | None = None
        self._pending: tuple[GraphState, int, float] | None = None
        self._completed: list[float] = []
        self.updates = self.skipped = 0
        self.rewards: list[float] = []  # of the transitions stored since `take_rewards`
        self._lock = threading.Lock()  # the replay, `_owed` and `rewards`
        self._owed = 0
        self._training = False
        self._wake: threading.Event | None = None
        if background:
            self._wake = threading.Event()
            thread = threading.Thread(target=_learn, args=(weakref.ref(self), self._wake),
                                      name="qos-drl-online", daemon=True)
            _THREADS[:] = [(t, w) for t, w in _THREADS if t.is_alive()]
            _THREADS.append((thread, self._wake))
            thread.start()

    def completed(self, phi: float) -> None:
        self._completed.append(phi)

    def decided(self, state: GraphState, action: int, penalty: float) -> None:
        if self._pending is not None:
            previous, prev_action, prev_penalty = self._pending
            r = reward(self._completed, prev_penalty)
            self._completed = []
            with self._lock:
                if self.replay is None:
                    self.replay = Replay(10_000, previous)
                self.replay.add(previous, prev_action, r, state, False)
                self.rewards.append(r)
                if self.replay.size >= self.warmup:
                    self._owed += 1
                    if self._owed > self.MAX_OWED:
                        self._owed, self.skipped = self.MAX_OWED, self.skipped + 1
            if self._wake is None:
                self.train_owed()
            else:
                self._wake.set()
        self._pending = (state, action, penalty)

    def train_owed(self) -> None:
        """Run the owed updates (the learning thread's work; inline without one)."""
        while not _EXITING.is_set():
            with self._lock:
                if self._owed == 0 or self.replay is None:
                    return
                self._owed -= 1
                self._training = True
                sample = self.replay.sample(self.batch)
            try:
                self.agent.train()
                self.agent.update(*sample)
                self.agent.eval()
                self.acting = ActingCopy(self.agent)
                self.updates += 1
            finally:
                with self._lock:
                    self._training = False
            if self.on_report is not None and self.updates % self.report_every == 0:
                self.on_report(self)

    def take_rewards(self) -> list[float]:
        with self._lock:
            taken, self.rewards = self.rewards, []
        return taken

    def idle(self) -> bool:
        """No update owed or running."""
        with self._lock:
            return self._owed == 0 and not self._training

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until `idle` (the thread has run every owed update), at most `timeout_s`
        (benchmarks and tests count updates after it); whether it is."""
        deadline = time.monotonic() + timeout_s
        while not self.idle():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True


_THREADS: list[tuple[threading.Thread, threading.Event]] = []  # the learning threads
_EXITING = threading.Event()


@atexit.register
def _stop_learning() -> None:
    """At exit, let each learning thread finish its update: the interpreter tearing down
    under a thread inside torch aborts the process."""
    _EXITING.set()
    for thread, wake in _THREADS:
        wake.set()
        thread.join(timeout=5)


def _learn(ref: weakref.ref[OnlineLearner], wake: threading.Event) -> None:
    """The learning thread: it holds its learner weakly and ends once the policy that
    owned it is gone (a policy switch or reload), or at exit."""
    while True:
        woken = wake.wait(timeout=1.0)
        learner = ref()
        if learner is None or _EXITING.is_set():
            return
        if woken:
            wake.clear()
            try:
                learner.train_owed()
            except Exception:  # one bad batch must not end online learning
                log.exception("qos_drl online update failed")
        del learner
