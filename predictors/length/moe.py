"""GoodServe's Mixture-of-Experts output-length predictor (goodserve.txt §3.2).

What the paper fixes, and how it is built here:

* features h_r: TF-IDF over the token window so far (`predictors.length.features`);
* a gating router R, a two-layer MLP, gives p_r = softmax(R(h_r)) over K experts;
* K = 9 experts E_k, four-layer MLPs; the prediction is ŷ_r = Σ_k p_r,k E_k(h_r);
* two-phase training (`predictors.length.train`): half of the data is split into K
  subsets by √K = 3 tiers of input x output length, one expert per subset; then,
  experts frozen, the router is trained on the other half; 500 epochs.

What the paper leaves open, chosen here (and why):

* layer sizes: experts D → 128 → 64 → 32 → 1, router D → 64 → K, D = 1024 TF-IDF
  terms + 2 length features: ~1.3 M parameters, not the paper's 45.1 M, which fit 8680
  samples; here a model has 644 training prompts and each expert ~36 of them;
* ReLU; Adam (lr 1e-2, batch 128, no weight decay); L1 loss on length / the model's
  mean length, because the reported metric is MAE and lengths are heavy-tailed.
  Vocabulary size and lr were chosen on a validation split (ids % 5 == 1 of the
  training ids), never on the held-out split;
* the first layer of every MLP reads the sparse TF-IDF vector directly
  (`EmbeddingBag` in "sum" mode = a Linear layer over a sparse input), so its cost is
  the number of terms present, not D.

Deviations: two length features are appended to the TF-IDF vector (see
`predictors.length.features`); the model predicts the tokens still to come, so one model
serves the arrival estimate (nothing generated) and the re-estimate every τ tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class MoEConfig:
    experts: int = 9  # K; tiers = √K per length axis
    expert_hidden: tuple[int, ...] = (128, 64, 32)  # 3 hidden + output = 4 layers
    router_hidden: int = 64  # 1 hidden + output = 2 layers
    epochs: int = 500  # per phase, as in the paper
    lr: float = 1e-2
    weight_decay: float = 0.0  # decoupled (AdamW-style); the paper names no regulariser
    batch_size: int = 128
    seed: int = 0

    @property
    def tiers(self) -> int:
        tiers = math.isqrt(self.experts)
        if tiers * tiers != self.experts:
            raise ValueError(f"K={self.experts} is not a square: tiers need √K per axis")
        return tiers


@dataclass(frozen=True, slots=True)
class SparseBatch:
    """Rows of (index, weight) pairs, flattened the way `EmbeddingBag` takes them."""

    indices: Tensor  # int64, all rows' indices concatenated
    offsets: Tensor  # int64, where each row starts in `indices`
    weights: Tensor  # float32, one per index

    @classmethod
    def of(cls, rows: Sequence[tuple[Sequence[int], Sequence[float]]]) -> SparseBatch:
        lengths = torch.tensor([len(i) for i, _ in rows], dtype=torch.int64)
        return cls(
            torch.tensor([j for i, _ in rows for j in i], dtype=torch.int64),
            torch.cumsum(lengths, 0) - lengths,
            torch.tensor([x for _, w in rows for x in w], dtype=torch.float32),
        )


class SparseMLP(nn.Module):
    """An MLP whose first Linear layer reads a sparse vector."""

    def __init__(self, dim: int, hidden: Sequence[int], out: int) -> None:
        super().__init__()
        self.first = nn.EmbeddingBag(dim, hidden[0], mode="sum", sparse=True)
        self.first_bias = nn.Parameter(torch.zeros(hidden[0]))
        layers: list[nn.Module] = []
        for width_in, width_out in zip(hidden, [*hidden[1:], out], strict=True):
            layers += [nn.ReLU(), nn.Linear(width_in, width_out)]
        self.rest = nn.Sequential(*layers)

    def forward(self, batch: SparseBatch) -> Tensor:
        first = self.first(batch.indices, batch.offsets, per_sample_weights=batch.weights)
        out: Tensor = self.rest(first + self.first_bias)
        return out

    def linears(self) -> list[nn.Linear]:
        return [m for m in self.rest if isinstance(m, nn.Linear)]


class MoELength(nn.Module):
    """Router + experts; outputs are lengths in units of the model's mean length."""

    def __init__(self, dim: int, config: MoEConfig) -> None:
        super().__init__()
        self.router = SparseMLP(dim, [config.router_hidden], config.experts)
        self.experts = nn.ModuleList(
            SparseMLP(dim, config.expert_hidden, 1) for _ in range(config.experts))

    def expert_outputs(self, batch: SparseBatch) -> Tensor:
        return torch.cat([expert(batch) for expert in self.experts], dim=1)

    def forward(self, batch: SparseBatch) -> Tensor:
        gate = torch.softmax(self.router(batch), dim=1)
        return (gate * self.expert_outputs(batch)).sum(dim=1)


class FusedMoE:
    """The same function as a trained `MoELength`, in a dozen tensor ops.

    One `embedding_bag` computes the first layer of the router and all K experts at
    once; the experts' later layers run as batched matmuls. Per request this avoids
    ~70 small module calls (Python and dispatch overhead dominate at this size).
    """

    def __init__(self, model: MoELength) -> None:
        experts = cast(list[SparseMLP], list(model.experts))
        self.k = len(experts)
        self._one_bag = torch.zeros(1, dtype=torch.int64)  # offsets of a single request
        self.router_width = model.router.first_bias.numel()
        first = [model.router.first.weight, *(e.first.weight for e in experts)]
        bias: list[Tensor] = [model.router.first_bias, *(e.first_bias for e in experts)]
        self.first = torch.cat(first, dim=1).detach().contiguous()
        self.first_bias = torch.cat(bias).detach()
        router_out = model.router.linears()[0]
        self.router_w = router_out.weight.detach().t().contiguous()
        self.router_b = router_out.bias.detach()
        self.layers = [_stack([e.linears()[i] for e in experts])
                       for i in range(len(experts[0].linears()))]

    def __call__(self, indices: Tensor, weights: Tensor) -> float:
        first = torch.nn.functional.embedding_bag(
            indices, self.first, self._one_bag,
            mode="sum", per_sample_weights=weights)[0] + self.first_bias
        hidden = torch.relu(first)
        gate = torch.softmax(hidden[: self.router_width] @ self.router_w + self.router_b, 0)
        x = hidden[self.router_width:].view(self.k, 1, -1)
        for weight, bias in self.layers:
            x = torch.baddbmm(bias, x, weight)
            if weight.shape[2] != 1:
                x = torch.relu(x)
        return float(gate @ x.view(self.k))


def _stack(linears: list[nn.Linear]) -> tuple[Tensor, Tensor]:
    """One layer of every expert as [K, in, out] weights and [K, 1, out] biases."""
    weight = torch.stack([lin.weight.detach().t() for lin in linears]).contiguous()
    bias = torch.stack([lin.bias.detach().unsqueeze(0) for lin in linears])
    return weight, bias
