"""What qos_drl remembers between decisions: the requests it routed (the request nodes
of its state graph, and the running queues of Eq. 15) and, when learning online, the
pending transition whose reward the next decision completes (Eq. 16)."""

from __future__ import annotations

from dataclasses import dataclass

from policies.qos_impact import Coefficients, RunningRequest, impact, reward
from policies.qos_replay import Replay
from policies.qos_sac import SacAgent
from policies.qos_state import GraphState, RequestFeatures
from proxy.types import Backend, BackendStats, ClusterView


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
    """Turns (decision, completions since, next decision) into SAC transitions."""

    def __init__(self, agent: SacAgent, warmup: int, batch: int) -> None:
        self.agent, self.warmup, self.batch = agent, warmup, batch
        self.replay: Replay | None = None
        self._pending: tuple[GraphState, int, float] | None = None
        self._completed: list[float] = []
        self.updates = 0
        self.rewards: list[float] = []  # of the transitions stored since `take_rewards`

    def completed(self, phi: float) -> None:
        self._completed.append(phi)

    def decided(self, state: GraphState, action: int, penalty: float) -> None:
        if self._pending is not None:
            previous, prev_action, prev_penalty = self._pending
            if self.replay is None:
                self.replay = Replay(10_000, previous)
            r = reward(self._completed, prev_penalty)
            self.replay.add(previous, prev_action, r, state, False)
            self.rewards.append(r)
            self._completed = []
            if self.replay.size >= self.warmup:
                self.agent.train()
                self.agent.update(*self.replay.sample(self.batch))
                self.agent.eval()
                self.updates += 1
        self._pending = (state, action, penalty)


    def take_rewards(self) -> list[float]:
        taken, self.rewards = self.rewards, []
        return taken
