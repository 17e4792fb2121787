"""Next-token training of a tiny model on the CPU (the `moe-lm` variant's build).

One document per row (truncated to `seq_len`, right-padded, padding masked out of
attention and loss), AdamW with a linear warm-up and a cosine decay. For an MoE the
router's load-balancing loss is on (`output_router_logits`), as in real MoE training,
so experts stay in use while they specialise. Seeded: a build is reproducible on one
machine and torch version.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TrainSpec:
    steps: int
    batch: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 50
    aux_loss_coef: float = 0.01  # MoE load balancing (Switch/Mixtral use 0.01-0.02)
    seed: int = 0


def train_lm(model: Any, tokenizer: Any, texts: Sequence[str], spec: TrainSpec
             ) -> dict[str, Any]:
    """Train `model` in place; returns the loss curve (every 50 steps) and the time."""
    import torch

    torch.manual_seed(spec.seed)
    rows = [ids[:spec.seq_len] for ids in tokenizer(list(texts))["input_ids"] if len(ids) > 1]
    moe = hasattr(model.config, "num_experts")
    if moe:
        model.config.router_aux_loss_coef = spec.aux_loss_coef
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    order = torch.Generator().manual_seed(spec.seed)
    model.train()
    curve, recent, started = [], [], time.monotonic()
    for step in range(spec.steps):
        for group in optimizer.param_groups:
            group["lr"] = spec.lr * _schedule(step, spec)
        picked = torch.randint(len(rows), (spec.batch,), generator=order).tolist()
        input_ids, mask, labels = _batch([rows[i] for i in picked], tokenizer.pad_token_id)
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels,
                    output_router_logits=moe)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        recent.append(out.loss.item())
        if (step + 1) % 50 == 0 or step + 1 == spec.steps:
            curve.append([step + 1, round(sum(recent) / len(recent), 4)])
            recent = []
    model.eval()
    return {"loss_curve": curve, "train_s": round(time.monotonic() - started, 1),
            "documents": len(rows), **{k: getattr(spec, k) for k in spec.__slots__}}


def _schedule(step: int, spec: TrainSpec) -> float:
    if step < spec.warmup:
        return (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _batch(rows: list[list[int]], pad_id: int) -> tuple[Any, Any, Any]:
    import torch

    longest = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for n, row in enumerate(rows):
        input_ids[n, :len(row)] = torch.tensor(row)
        mask[n, :len(row)] = 1
    labels = input_ids.masked_fill(mask == 0, -100)
    return input_ids, mask, labels
