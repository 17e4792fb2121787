"""In-process discrete-event simulator of N expert models for qos_drl (issue 8, point 4).

Every expert is a `bench.emulator.engine.Engine` in manual mode — the harness
emulator's vLLM-like scheduler (continuous batching, KV blocks, preemption) on a
step-time model fitted on real vLLM-CPU or derived for a GPU — so the simulator and
the emulated fleet share one latency model. Requests arrive as a Poisson process of
rate λ (or, with `TraceArrivals`, at the times of a real trace scaled to mean rate λ);
each is one alpaca_eval prompt whose length and score on expert n are that expert's
real answer length (counted by the project) and judge win rate.

`arrive()` advances every engine to the next arrival and returns the request;
`route(action)` sends it (0 = drop, n = expert n-1) and returns Eq. 15's impact;
`completed` holds φ of every request finished since the last call to `take_completed`.

`cores`: the experts share that many CPU cores (the vLLM-CPU tiny fleet on one
machine, each engine stepping on one core; fractional when other processes take part
of the machine, see bench.studies.qos.setup.TINY_CORES): a step that starts while k engines have
work lasts max(solo, k / cores) times the profile's, `solo` (≥ 1) the slowdown of an
engine busy alone (bench.studies.qos.setup.TINY_SOLO_SLOWDOWN: its core is not quite its own).
None (the GPU fleet): every expert has its own hardware.
"""

from __future__ import annotations

import copy
import itertools
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.emulator.engine import Engine
from bench.emulator.profile import Profile
from bench.emulator.sequence import Sequence as Seq
from bench.fakes.fake_metrics import FakeStats
from policies.qos_drl.impact import Coefficients, RunningRequest, impact, qos
from policies.qos_drl.state import ExpertState, GraphState, RequestFeatures, build_state
from predictors.home import open_text


@dataclass(frozen=True, slots=True)
class PoolPrompt:
    """One prompt with, per expert, its real (score, length) and predicted ones."""

    id: int
    prompt_tokens: int
    scores: tuple[float, ...]
    lengths: tuple[int, ...]
    pred_scores: tuple[float, ...]
    pred_lengths: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class TraceArrivals:
    """Arrival times of a real trace (seconds, sorted), replayed in place of Poisson
    gaps, as the paper's real-world evaluation replays BurstGPT "during a period with
    average arrival rate λ" (qos_drl_edge_routing.txt §VI-A b): each reset picks a
    seeded window of `window` arrivals and scales its time so that its mean rate is λ;
    arrivals past the window continue from its start. `spread`: arrivals logged at one
    timestamp are spread uniformly (seeded) up to the next logged timestamp (the
    Mooncake conversation trace logs arrivals in 3-s steps); without it they arrive
    together."""

    times: tuple[float, ...]
    window: int
    spread: bool = True

    def __post_init__(self) -> None:
        if len(self.times) < self.window + 1 or self.window < 1:
            raise ValueError(f"a trace of {len(self.times)} arrivals has no window of "
                             f"{self.window}")

    def draw(self, seed: int, rate: float) -> list[float]:
        """The gaps `QosSim.reset(seed)` replays (and `bench.studies.qos.live` sends) at `rate`."""
        return self.gaps(random.Random(seed + 2), rate)

    def gaps(self, rng: random.Random, rate: float) -> list[float]:
        """The gaps of one window, seeded by `rng`, scaled to mean 1/`rate`."""
        start = rng.randrange(len(self.times) - self.window)
        times = list(self.times[start:start + self.window + 1])
        if self.spread:
            times = spread_groups(times, rng)
        gaps = [b - a for a, b in itertools.pairwise(times)]
        mean = sum(gaps) / len(gaps)
        if mean <= 0:
            raise ValueError("a trace window whose arrivals all share one time")
        return [g / (mean * rate) for g in gaps]


def trace_times(path: Path) -> tuple[float, ...]:
    """Arrival times in seconds of a Mooncake-format trace (`timestamp`, ms), sorted."""
    with open_text(path) as f:
        return tuple(sorted(json.loads(line)["timestamp"] / 1000 for line in f if line.strip()))


def spread_groups(times: Sequence[float], rng: random.Random) -> list[float]:
    """Each run of equal times spread uniformly over the step to the next distinct time
    (the last run over the median step), sorted."""
    distinct = sorted(set(times))
    steps = [b - a for a, b in itertools.pairwise(distinct)]
    last = sorted(steps)[len(steps) // 2] if steps else 0.0
    step_after = dict(zip(distinct, [*steps, last], strict=True))
    return sorted(t + rng.random() * step_after[t] for t in times)


@dataclass(frozen=True, slots=True)
class ExpertSpec:
    name: str
    profile: Profile
    k: Coefficients


@dataclass(slots=True)
class SimRequest:
    prompt: PoolPrompt
    arrival: float
    expert: int = -1
    seq: Seq | None = None
    qos: float | None = None
    latency_per_token: float | None = None


@dataclass(slots=True)
class Expert:
    spec: ExpertSpec
    engine: Engine
    requests: dict[int, SimRequest] = field(default_factory=dict)  # id(seq) -> request


class QosSim:
    def __init__(self, experts: Sequence[ExpertSpec], pool: Sequence[PoolPrompt],
                 rate: float, limit_s: float, seed: int = 0, cores: float | None = None,
                 solo: float = 1.0, speed: float = 1.0,
                 trace: TraceArrivals | None = None) -> None:
        """`speed`: every engine step lasts this many times the model's (> 1: a machine
        slower than the one the profiles and `cores` were fitted on; < 1: faster).
        `trace`: arrivals at a real trace's times instead of Poisson ones."""
        self.specs, self.pool, self.rate, self.limit = list(experts), list(pool), rate, limit_s
        self.seed, self.cores, self.solo, self.speed = seed, cores, solo, speed
        self.trace = trace
        self.reset(seed)

    def reset(self, seed: int | None = None) -> None:
        """Fresh engines; with `seed`, the same arrivals as every reset with that seed
        (prompt ids come from their own generator, so actions never shift arrivals)."""
        if seed is not None:
            self.rng = random.Random(seed)
            self.ids_rng = random.Random(seed + 1)
            self.trace_gaps = [] if self.trace is None else self.trace.draw(seed, self.rate)
            self.arrived = 0
        self.experts = [Expert(s, Engine(s.profile, FakeStats(keep_bodies=False), manual=True))
                        for s in self.specs]
        for expert in self.experts:  # shared cores: _share_cores sets it before each step
            expert.engine.slowdown = self.speed
        self.now = 0.0
        self.current: SimRequest | None = None
        self.finished: list[SimRequest] = []  # every request with a final φ (drops too)
        self.completed: list[float] = []  # φ of completions since take_completed

    def arrive(self) -> SimRequest:
        """Advance to the next arrival (Poisson, or the trace's); it becomes `current`."""
        if self.trace_gaps:
            gap = self.trace_gaps[self.arrived % len(self.trace_gaps)]
        else:
            gap = self.rng.expovariate(self.rate)
        self.arrived += 1
        self.advance_to(self.now + gap)
        self.current = SimRequest(self.rng.choice(self.pool), self.now)
        return self.current

    def route(self, action: int) -> float:
        """Send `current` (0: drop); returns the impact estimate of the action (Eq. 15)."""
        req = self.current
        assert req is not None
        if action == 0:
            req.qos = 0.0
            self.finished.append(req)
            return 0.0
        n = action - 1
        expert = self.experts[n]
        p, d = req.prompt.prompt_tokens, req.prompt.lengths[n]
        penalty = impact(expert.spec.k, self.running(n), p, d, self.limit)
        ids = [self.ids_rng.randrange(1, 30000) for _ in range(p)]  # no accidental prefix hits
        req.expert, req.seq = n, Seq(ids, 0, d, self.now)
        expert.requests[id(req.seq)] = req
        expert.engine.now = max(expert.engine.now, self.now)
        self._share_cores(expert.engine)
        expert.engine.add(req.seq)
        return penalty

    def take_completed(self) -> list[float]:
        done, self.completed = self.completed, []
        return done

    def advance_to(self, until: float) -> None:
        if self.cores is None:  # independent engines: each runs on to `until`
            for expert in self.experts:
                engine = expert.engine
                while engine._step_end is not None and engine._step_end <= until:
                    engine.advance()
                    self._collect(expert)
        else:
            self._in_time_order(until)
        self.now = until

    def _in_time_order(self, until: float) -> None:
        """Shared cores: the engines' steps in time order, each step started at the
        load of its start."""
        while True:
            self._share_cores()
            due = [e for e in self.experts
                   if e.engine._step_end is not None and e.engine._step_end <= until]
            if not due:
                return
            expert = min(due, key=lambda e: e.engine._step_end or 0.0)
            expert.engine.advance()
            self._collect(expert)

    def _share_cores(self, starting: Engine | None = None) -> None:
        """Every engine's next step lasts speed * max(solo, k / cores) times the
        profile's, k = the engines with work (counting `starting`, an idle engine about
        to step)."""
        if self.cores is None:
            return
        busy = sum(1 for e in self.experts if e.engine._step_end is not None)
        if starting is not None and starting._step_end is None:
            busy += 1
        for expert in self.experts:
            expert.engine.slowdown = self.speed * max(self.solo, busy / self.cores)

    def what_if(self, action: int) -> list[SimRequest]:
        """Every request in the fleet now, `current` sent by `action`, as it would finish
        with no further arrivals (φ, latency per token): on a copy, this one untouched."""
        keep = self.pool, self.finished, self.completed  # not needed there: not copied
        self.pool, self.finished, self.completed = [], [], []
        try:
            twin = copy.deepcopy(self)  # its own generators too: this one's stay as they are
        finally:
            self.pool, self.finished, self.completed = keep
        for expert in twin.experts:  # keyed by id(seq): the copies' ids
            expert.requests = {id(r.seq): r for r in expert.requests.values()}
        twin.route(action)
        twin.drain()
        return twin.finished

    def drain(self) -> None:
        """Run every engine until idle (end of an evaluation)."""
        if self.cores is not None:
            self._in_time_order(float("inf"))
        for expert in self.experts:
            while expert.engine.advance():
                self._collect(expert)

    def _collect(self, expert: Expert) -> None:
        for key, req in list(expert.requests.items()):
            seq = req.seq
            assert seq is not None
            if not seq.done:
                continue
            del expert.requests[key]
            n, prompt = req.expert, req.prompt
            req.latency_per_token = (expert.engine.now - req.arrival) / prompt.lengths[n]
            req.qos = qos(prompt.scores[n], req.latency_per_token, self.limit)
            self.completed.append(req.qos)
            self.finished.append(req)

    # -- what the router sees ------------------------------------------------------
    def _features(self, expert: Expert, seq: Seq) -> tuple[SimRequest, RequestFeatures]:
        req = expert.requests[id(seq)]
        n = req.expert
        elapsed = self.now - req.arrival
        return req, RequestFeatures(
            req.prompt.prompt_tokens, req.prompt.pred_scores[n], req.prompt.pred_lengths[n],
            seq.blocks / expert.spec.profile.kv_blocks, seq.output,
            elapsed / max(1, seq.output))

    def running(self, n: int) -> list[RunningRequest]:
        expert = self.experts[n]
        out = []
        for seq in expert.engine.running:
            req, f = self._features(expert, seq)
            out.append(RunningRequest(f.prompt_tokens, req.prompt.lengths[n], f.generated,
                                      f.latency_per_token, req.prompt.scores[n]))
        return out

    def expert_states(self) -> list[ExpertState]:
        states = []
        for expert in self.experts:
            engine = expert.engine
            running = [self._features(expert, s)[1] for s in reversed(engine.running)]
            waiting = [self._features(expert, s)[1] for s in engine.waiting]
            states.append(ExpertState(engine.kv.used_blocks / engine.profile.kv_blocks,
                                      len(engine.running), len(engine.waiting),
                                      tuple(running), tuple(waiting)))
        return states

    def state(self) -> GraphState:
        req = self.current
        assert req is not None
        return build_state(req.prompt.prompt_tokens, req.prompt.pred_scores,
                           req.prompt.pred_lengths, self.expert_states(), self.limit)
