"""The global state of qos_drl (qos_drl_edge_routing.txt §V-B) as fixed-size arrays.

Request features, Eq. 6: f_q = (p_j, ŝ_j, d̂_j, e_{j,n,t}, d_{j,t}, l_{j,t}).
Expert features, Eq. 10: (e_{n,t}, |Q_running|, |Q_waiting|), plus a one-hot expert
id (the arrived request's per-expert predictions are in a fixed expert order; the id
lets attention tell the experts apart). The arrived request node holds p_j and its
predicted score and length on every expert (ŝ_{j,n}, d̂_{j,n}). Up to `cap` (5, the
paper's default) running and waiting requests per expert become request nodes; the
counts keep the full queue lengths. Scaled to O(1): tokens / 1000, latency / L.
Baseline RL sees only the expert-level features (`expert_level`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

REQ_FEATURES = 6
QUEUE_CAP = 5
TOKEN_SCALE = 1000.0
COUNT_SCALE = 10.0


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    prompt_tokens: int
    score: float  # predicted ŝ on the expert that holds it
    length: float  # predicted d̂ on that expert
    memory: float  # e_{j,n,t}: its KV share of the expert's capacity
    generated: int  # d_{j,t}
    latency_per_token: float  # l_{j,t}, seconds


@dataclass(frozen=True, slots=True)
class ExpertState:
    memory: float  # e_{n,t}
    running_count: int
    waiting_count: int
    running: tuple[RequestFeatures, ...]  # most recent first; only `cap` are used
    waiting: tuple[RequestFeatures, ...]


@dataclass(frozen=True, slots=True)
class GraphState:
    """Node features of one heterogeneous graph; masks mark real request nodes."""

    arrived: np.ndarray  # [1 + 2N]
    experts: np.ndarray  # [N, 3 + N]
    running: np.ndarray  # [N, cap, REQ_FEATURES]
    running_mask: np.ndarray  # [N, cap] (1.0 = node present)
    waiting: np.ndarray
    waiting_mask: np.ndarray

    def expert_level(self) -> np.ndarray:
        """Baseline RL's raw state: (e_n, |running|, |waiting|) of every expert."""
        return self.experts[:, :3].reshape(-1).copy()


def _request_row(r: RequestFeatures, limit: float) -> list[float]:
    return [r.prompt_tokens / TOKEN_SCALE, r.score, r.length / TOKEN_SCALE, r.memory,
            r.generated / TOKEN_SCALE, min(r.latency_per_token / limit, 10.0)]


def _queue(reqs: Sequence[RequestFeatures], cap: int, limit: float
           ) -> tuple[np.ndarray, np.ndarray]:
    feats = np.zeros((cap, REQ_FEATURES), dtype=np.float32)
    mask = np.zeros(cap, dtype=np.float32)
    for i, r in enumerate(list(reqs)[:cap]):
        feats[i] = _request_row(r, limit)
        mask[i] = 1.0
    return feats, mask


def build_state(prompt_tokens: int, pred_scores: Sequence[float],
                pred_lengths: Sequence[float], experts: Sequence[ExpertState],
                limit: float, cap: int = QUEUE_CAP) -> GraphState:
    n = len(experts)
    arrived = np.array([prompt_tokens / TOKEN_SCALE, *pred_scores,
                        *(d / TOKEN_SCALE for d in pred_lengths)], dtype=np.float32)
    expert_rows = np.zeros((n, 3 + n), dtype=np.float32)
    running = np.zeros((n, cap, REQ_FEATURES), dtype=np.float32)
    waiting = np.zeros_like(running)
    running_mask = np.zeros((n, cap), dtype=np.float32)
    waiting_mask = np.zeros_like(running_mask)
    for i, e in enumerate(experts):
        expert_rows[i, :3] = (e.memory, e.running_count / COUNT_SCALE,
                              e.waiting_count / COUNT_SCALE)
        expert_rows[i, 3 + i] = 1.0
        running[i], running_mask[i] = _queue(e.running, cap, limit)
        waiting[i], waiting_mask[i] = _queue(e.waiting, cap, limit)
    return GraphState(arrived, expert_rows, running, running_mask, waiting, waiting_mask)
