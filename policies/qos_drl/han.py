"""Heterogeneous graph attention network over qos_drl's state graph (§V-B2), plain PyTorch.

Nodes: the arrived request (A), the N experts (E), up to `cap` running (R) and
waiting (W) requests per expert. Edges (Eqs. 9-12): R-E and W-E for the queue each
request is in, A-E for every expert; messages flow both ways. A HAN layer has
node-level attention (GAT, multi-head, per relation) and semantic-level attention
(one weight per relation, from the mean of q·tanh(W z_r) over the target nodes) for
targets with several relations (experts: from R, W and A), plus a self connection.

The graph has a fixed shape with masks (≤ 1 + N + 2·N·cap nodes), so batches are dense
tensors and no graph library is needed: PyTorch Geometric would add a dependency for
what is ~100 lines here. Request nodes are held packed, only the present ones (a
`Slots` row each): on the simulator's states about a quarter of the 2·N·cap slots are
filled (paper fleet, λ 5), and computing every slot made a SAC update (batch 32) take
~24 ms here instead of ~15. An absent slot's message was masked to exactly 0, so the
packed network computes the same embeddings with the same parameters (checkpoints of
the dense one load and decide identically; tests/policies/qos_drl/test_qos_han.py keeps the
dense form as the reference).

Relations with one source per target (A → each expert, each expert → its request
nodes) have attention weight 1: their message is the source's projection, and their
attention vectors and `dst` projection take no part (kept so checkpoints load).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class Slots:
    """The present sources of one relation in a batch laid out [B,T,S] (T targets with
    up to S source slots each): their flat slot indices (`rows`), their target's flat
    index b·T + t (`target`), and the layout."""

    rows: torch.Tensor
    target: torch.Tensor
    shape: tuple[int, int, int]

    @classmethod
    def of(cls, mask: torch.Tensor) -> Slots:
        """The slots where `mask` [B,T,S] > 0."""
        b, t, s = mask.shape
        rows = (mask.reshape(-1) > 0).nonzero().squeeze(1)
        return cls(rows, torch.div(rows, s, rounding_mode="floor"), (b, t, s))

    @classmethod
    def full(cls, b: int, t: int, s: int) -> Slots:
        rows = torch.arange(b * t * s)
        return cls(rows, torch.div(rows, s, rounding_mode="floor"), (b, t, s))

    def pack(self, dense: torch.Tensor) -> torch.Tensor:
        """[B,T,S,F] → [P,F], the present slots' rows."""
        return dense.reshape(-1, dense.shape[-1]).index_select(0, self.rows)


class RelationAttention(nn.Module):
    """GAT attention of target nodes over their sources for one relation."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.dim = heads, hidden // heads
        self.src = nn.Linear(hidden, hidden, bias=False)
        self.att_src = nn.Parameter(torch.randn(heads, self.dim) * 0.1)
        self.att_dst = nn.Parameter(torch.randn(heads, self.dim) * 0.1)
        self.dst = nn.Linear(hidden, hidden, bias=False)

    def forward(self, target: torch.Tensor, src: torch.Tensor, slots: Slots) -> torch.Tensor:
        """target [B,T,H], the present sources projected by `self.src` [P,H] (`slots`)
        → messages [B,T,H]; a target without sources gets none (zeros)."""
        (b, t, s), h = slots.shape, src.shape[-1]
        heads = src.view(-1, self.heads, self.dim)
        dst = self.dst(target).view(b * t, self.heads, self.dim)
        logits = F.leaky_relu((heads * self.att_src).sum(-1) + (dst * self.att_dst).sum(-1)
                              .index_select(0, slots.target), 0.2)  # [P,heads]
        # softmax over each target's slots, absent ones at -1e9
        dense = logits.new_full((b * t * s, self.heads), -1e9).index_copy(0, slots.rows, logits)
        alpha = torch.softmax(dense.view(b, t, s, self.heads), dim=2).view(-1, self.heads)
        weighted = (alpha.index_select(0, slots.rows).unsqueeze(-1) * heads).view(-1, h)
        # summed per target in the dense layout: index_add has no ONNX export
        out = weighted.new_zeros(b * t * s, h).index_copy(0, slots.rows, weighted)
        return out.view(b, t, s, h).sum(2)


class SemanticAttention(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.query = nn.Linear(hidden, 1, bias=False)

    def forward(self, per_relation: list[torch.Tensor]) -> torch.Tensor:
        stacked = torch.stack(per_relation, dim=2)  # [B,T,R,H]
        weights = self.query(torch.tanh(self.proj(stacked))).mean(dim=1, keepdim=True)
        beta = torch.softmax(weights, dim=2)  # [B,1,R,1]
        return (beta * stacked).sum(2)


class HANLayer(nn.Module):
    RELATIONS = ("e_from_r", "e_from_w", "e_from_a", "a_from_e", "r_from_e", "w_from_e")

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.rel = nn.ModuleDict({r: RelationAttention(hidden, heads) for r in self.RELATIONS})
        self.expert_semantic = SemanticAttention(hidden)
        self.self_loop = nn.ModuleDict({t: nn.Linear(hidden, hidden) for t in "aerw"})

    def relation(self, name: str) -> RelationAttention:
        relation = self.rel[name]
        assert isinstance(relation, RelationAttention)
        return relation

    def forward(self, h: dict[str, torch.Tensor], slots: dict[str, Slots],
                last: bool = False) -> dict[str, torch.Tensor]:
        """One propagation; `last` skips the request nodes (only A and E are read out).
        h: a [B,1,H], e [B,N,H], r and w packed [P,H] (`slots`)."""
        a, e = h["a"], h["e"]
        b, n, hidden = e.shape
        to_e = []
        for k in "rw":
            relation = self.relation(f"e_from_{k}")
            to_e.append(relation(e, relation.src(h[k]), slots[k]))
        # one source (A) per expert: the message is the projection (module docstring)
        to_e.append(self.relation("e_from_a").src(a).expand(b, n, hidden))
        new_e = self.expert_semantic(to_e)
        from_e = self.relation("a_from_e").src(e).reshape(b * n, hidden)
        new_a = self.relation("a_from_e")(a, from_e, Slots.full(b, 1, n))
        out = {"a": F.elu(new_a + self.self_loop["a"](a)),
               "e": F.elu(new_e + self.self_loop["e"](e)), "r": h["r"], "w": h["w"]}
        if not last:
            # one source (its expert) each, as above
            for k in "rw":
                message = self.relation(f"{k}_from_e").src(e).reshape(b * n, hidden)
                out[k] = F.elu(message.index_select(0, slots[k].target)
                               + self.self_loop[k](h[k]))
        return out


class HAN(nn.Module):
    """Embeds a batch of state graphs; returns (arrived [B,H], experts [B,N,H])."""

    def __init__(self, arrived_dim: int, expert_dim: int, request_dim: int,
                 hidden: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.inputs = nn.ModuleDict({"a": nn.Linear(arrived_dim, hidden),
                                     "e": nn.Linear(expert_dim, hidden),
                                     "r": nn.Linear(request_dim, hidden),
                                     "w": nn.Linear(request_dim, hidden)})
        self.layers = nn.ModuleList(HANLayer(hidden, heads) for _ in range(layers))

    def forward(self, g: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        slots = {"r": Slots.of(g["running_mask"]), "w": Slots.of(g["waiting_mask"])}
        h = {"a": self.inputs["a"](g["arrived"]).unsqueeze(1),
             "e": self.inputs["e"](g["experts"]),
             "r": self.inputs["r"](slots["r"].pack(g["running"])),
             "w": self.inputs["w"](slots["w"].pack(g["waiting"]))}
        for i, layer in enumerate(self.layers):
            h = layer(h, slots, last=i == len(self.layers) - 1)
        return h["a"].squeeze(1), h["e"]
