"""Routers over the qos_drl simulator and their evaluation (issue 8, points 6-7a).

A router maps the simulator (its `current` request and queues) to an action:
0 = drop, n = expert n-1. Baselines as in the paper (§VI-A): BERT router (argmax of
the predicted score; here the MiniLM bucket predictor), round robin, shortest queue
first; the RL agents (qos_drl, Baseline RL) act greedily on their state.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from bench.studies.qos.sim import QosSim
from policies.qos_drl.sac import SacAgent, batch_states

Router = Callable[[QosSim], int]


def bert_router(seed: int = 0) -> Router:
    rng = random.Random(seed)

    def route(sim: QosSim) -> int:
        assert sim.current is not None
        scores = sim.current.prompt.pred_scores
        best = max(scores)
        return 1 + rng.choice([i for i, s in enumerate(scores) if s == best])

    return route


def round_robin() -> Router:
    turn = [0]

    def route(sim: QosSim) -> int:
        turn[0] += 1
        return 1 + turn[0] % len(sim.experts)

    return route


def shortest_queue(sim: QosSim) -> int:
    loads = [len(e.engine.running) + len(e.engine.waiting) for e in sim.experts]
    return 1 + int(np.argmin(loads))


def agent_router(agent: SacAgent, greedy: bool = True) -> Router:
    def route(sim: QosSim) -> int:
        return agent.act(batch_states([sim.state()]), greedy=greedy)[0]

    return route


def beats_every_baseline(qos_at: Mapping[str, Mapping[str, float]]) -> bool:
    """{λ: {policy: avg QoS}}: whether qos_drl is above every other policy (its own
    variants, qos_drl_*, aside) at every λ."""
    return all(q["qos_drl"] > max(v for k, v in q.items() if not k.startswith("qos_drl"))
               for q in qos_at.values())


@dataclass(frozen=True, slots=True)
class EvalResult:
    avg_qos: float  # mean φ over every arrival (a drop counts 0)
    drop_rate: float
    lpt_mean_ms: float  # latency per token of the completed requests
    lpt_p50_ms: float
    lpt_p90_ms: float
    lpt_p99_ms: float
    within_limit: float  # completed requests with l_j <= L
    arrivals: int
    expert_share: list[float]  # fraction of arrivals sent to each expert


def evaluate(sim: QosSim, router: Router, arrivals: int) -> EvalResult:
    """`arrivals` requests from a fresh fleet (the same ones for every router), drained."""
    sim.reset(sim.seed)
    for _ in range(arrivals):
        sim.arrive()
        sim.route(router(sim))
    sim.drain()
    done = sim.finished
    lpt = np.array([r.latency_per_token for r in done if r.latency_per_token is not None])
    lpt_ms = lpt * 1000 if len(lpt) else np.zeros(1)
    drops = sum(1 for r in done if r.expert < 0)
    share = [sum(1 for r in done if r.expert == n) / len(done) for n in range(len(sim.experts))]
    return EvalResult(
        float(np.mean([r.qos or 0.0 for r in done])), drops / len(done),
        float(lpt_ms.mean()), float(np.percentile(lpt_ms, 50)),
        float(np.percentile(lpt_ms, 90)), float(np.percentile(lpt_ms, 99)),
        float((lpt <= sim.limit).mean()) if len(lpt) else 0.0, len(done), share)
