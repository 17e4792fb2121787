"""qos_drl's HAN written densely over every request slot, with masks, as §V-B2 reads
and as `policies.qos_drl.han` computed it until 2026-11-27: the reference the packed HAN is
tested against (same parameters, same embeddings) and the baseline its speed is
measured against (`bench.studies.qos.update_speed`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from policies.qos_drl.han import HAN, HANLayer, RelationAttention


def attention(rel: RelationAttention, target: torch.Tensor, sources: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """target [B,T,H], sources [B,T,S,H], mask [B,T,S]: softmax over every slot."""
    b, t, s, _ = sources.shape
    src = rel.src(sources).view(b, t, s, rel.heads, rel.dim)
    dst = rel.dst(target).view(b, t, 1, rel.heads, rel.dim)
    logits = F.leaky_relu((src * rel.att_src).sum(-1) + (dst * rel.att_dst).sum(-1), 0.2)
    logits = logits.masked_fill(mask.unsqueeze(-1) <= 0, -1e9)
    alpha = torch.softmax(logits, dim=2) * mask.unsqueeze(-1)
    out: torch.Tensor = (alpha.unsqueeze(-1) * src).sum(2).reshape(b, t, -1)
    return out


def layer_forward(layer: HANLayer, h: dict[str, torch.Tensor], masks: dict[str, torch.Tensor],
                  last: bool) -> dict[str, torch.Tensor]:
    a, e, r, w = h["a"], h["e"], h["r"], h["w"]
    b, n, _, hid = r.shape
    to_e = [attention(layer.relation("e_from_r"), e, r, masks["r"]),
            attention(layer.relation("e_from_w"), e, w, masks["w"]),
            attention(layer.relation("e_from_a"), e, a.unsqueeze(2).expand(b, n, 1, hid),
                      torch.ones(b, n, 1))]
    new_a = attention(layer.relation("a_from_e"), a, e.unsqueeze(1), torch.ones(b, 1, n))
    out = {"a": F.elu(new_a + layer.self_loop["a"](a)),
           "e": F.elu(layer.expert_semantic(to_e) + layer.self_loop["e"](e)), "r": r, "w": w}
    if not last:  # one source (its expert): attention weight 1, the message its projection
        for kind, x in (("r", r), ("w", w)):
            message = layer.relation(f"{kind}_from_e").src(e).unsqueeze(2)
            out[kind] = F.elu(message + layer.self_loop[kind](x))
    return out


def forward(han: HAN, g: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`han(g)` computed densely: (arrived [B,H], experts [B,N,H])."""
    h = {"a": han.inputs["a"](g["arrived"]).unsqueeze(1), "e": han.inputs["e"](g["experts"]),
         "r": han.inputs["r"](g["running"]), "w": han.inputs["w"](g["waiting"])}
    masks = {"r": g["running_mask"], "w": g["waiting_mask"]}
    for i, layer in enumerate(han.layers):
        assert isinstance(layer, HANLayer)
        h = layer_forward(layer, h, masks, last=i == len(han.layers) - 1)
    return h["a"].squeeze(1), h["e"]


class DenseHAN(HAN):
    """A HAN whose forward is the dense one (same parameters, so any HAN's state loads)."""

    def forward(self, g: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return forward(self, g)
