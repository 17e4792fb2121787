"""Heterogeneous graph attention network over qos_drl's state graph (§V-B2), plain PyTorch.

Nodes: the arrived request (A), the N experts (E), up to `cap` running (R) and
waiting (W) requests per expert. Edges (Eqs. 9-12): R-E and W-E for the queue each
request is in, A-E for every expert; messages flow both ways. A HAN layer has
node-level attention (GAT, multi-head, per relation) and semantic-level attention
(one weight per relation, from the mean of q·tanh(W z_r) over the target nodes) for
targets with several relations (experts: from R, W and A), plus a self connection.

The graph has a fixed shape with masks (≤ 1 + N + 2·N·cap nodes), so batches are dense
tensors and no graph library is needed: PyTorch Geometric would add a dependency for
what is ~100 lines here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RelationAttention(nn.Module):
    """GAT attention of target nodes over their sources for one relation."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.dim = heads, hidden // heads
        self.src = nn.Linear(hidden, hidden, bias=False)
        self.att_src = nn.Parameter(torch.randn(heads, self.dim) * 0.1)
        self.att_dst = nn.Parameter(torch.randn(heads, self.dim) * 0.1)
        self.dst = nn.Linear(hidden, hidden, bias=False)

    def forward(self, target: torch.Tensor, sources: torch.Tensor, mask: torch.Tensor
                ) -> torch.Tensor:
        """target [B,T,H], sources [B,T,S,H], mask [B,T,S] → messages [B,T,H]."""
        b, t, s, _ = sources.shape
        src = self.src(sources).view(b, t, s, self.heads, self.dim)
        dst = self.dst(target).view(b, t, 1, self.heads, self.dim)
        logits = F.leaky_relu((src * self.att_src).sum(-1) + (dst * self.att_dst).sum(-1), 0.2)
        logits = logits.masked_fill(mask.unsqueeze(-1) <= 0, -1e9)
        alpha = torch.softmax(logits, dim=2) * mask.unsqueeze(-1)  # no sources: no message
        out: torch.Tensor = (alpha.unsqueeze(-1) * src).sum(2).reshape(b, t, -1)
        return out


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

    def forward(self, h: dict[str, torch.Tensor], masks: dict[str, torch.Tensor],
                last: bool = False) -> dict[str, torch.Tensor]:
        """One propagation; `last` skips the request nodes (only A and E are read out)."""
        a, e, r, w = h["a"], h["e"], h["r"], h["w"]  # [B,1,H] [B,N,H] [B,N,C,H] x2
        b, n, _, hid = r.shape
        to_e = [self.rel["e_from_r"](e, r, masks["r"]), self.rel["e_from_w"](e, w, masks["w"]),
                self.rel["e_from_a"](e, a.unsqueeze(2).expand(b, n, 1, hid),
                                     torch.ones(b, n, 1))]
        new_e = self.expert_semantic(to_e)
        new_a = self.rel["a_from_e"](a, e.unsqueeze(1), torch.ones(b, 1, n))
        out = {"a": F.elu(new_a + self.self_loop["a"](a)),
               "e": F.elu(new_e + self.self_loop["e"](e)), "r": r, "w": w}
        if not last:
            # one source (its expert): attention weight 1, the message is the projection
            for kind, x in (("r", r), ("w", w)):
                relation = self.rel[f"{kind}_from_e"]
                assert isinstance(relation, RelationAttention)
                out[kind] = F.elu(relation.src(e).unsqueeze(2) + self.self_loop[kind](x))
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
        h = {"a": self.inputs["a"](g["arrived"]).unsqueeze(1),
             "e": self.inputs["e"](g["experts"]),
             "r": self.inputs["r"](g["running"]), "w": self.inputs["w"](g["waiting"])}
        masks = {"r": g["running_mask"], "w": g["waiting_mask"]}
        for i, layer in enumerate(self.layers):
            h = layer(h, masks, last=i == len(self.layers) - 1)
        return h["a"].squeeze(1), h["e"]
