"""GoodServe's two-phase training of the MoE length predictor, for one backend model.

Phase 1: one half of the prompts is cut into K = √K x √K subsets by tiers of input
(prompt tokens) and output (answer tokens) length, each tier edge a quantile of that
half, and expert k learns subset k alone. Phase 2: the experts are frozen and the
router learns, on the other half, to weight them. The halves split prompt ids (a
seeded permutation), so all rows of one prompt — every expert's answer and every
mid-stream window — fall on one side.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from predictors.length.data import Row, Sample
from predictors.length.features import Featurizer, SparseRow
from predictors.length.moe import MoEConfig, MoELength, SparseBatch


@dataclass(frozen=True, slots=True)
class SparseData:
    """Encoded rows in CSR form, so that a minibatch is a few tensor gathers."""

    indptr: Tensor
    indices: Tensor
    weights: Tensor

    @classmethod
    def of(cls, rows: Sequence[SparseRow]) -> SparseData:
        batch = SparseBatch.of(rows)
        end = torch.tensor([batch.indices.numel()], dtype=torch.int64)
        return cls(torch.cat([batch.offsets, end]), batch.indices, batch.weights)

    def batch(self, rows: Tensor) -> SparseBatch:
        starts = self.indptr[rows]
        lengths = self.indptr[rows + 1] - starts
        offsets = torch.cumsum(lengths, 0) - lengths
        positions = torch.repeat_interleave(starts - offsets, lengths) + torch.arange(
            int(lengths.sum()))
        return SparseBatch(self.indices[positions], offsets, self.weights[positions])


@dataclass(frozen=True, slots=True)
class Trained:
    model: MoELength
    scale: float  # tokens per model output unit (mean answer length)
    input_edges: tuple[float, ...]
    output_edges: tuple[float, ...]
    subset_sizes: tuple[int, ...]  # phase-1 rows per expert


def split_halves(ids: Sequence[int], seed: int) -> tuple[set[int], set[int]]:
    """Phase 1 ids, phase 2 ids: two halves of the distinct prompt ids."""
    unique = sorted(set(ids))
    random.Random(seed).shuffle(unique)
    middle = len(unique) // 2
    return set(unique[:middle]), set(unique[middle:])


def tier_edges(values: Sequence[int], tiers: int) -> tuple[float, ...]:
    quantiles = [i / tiers for i in range(1, tiers)]
    return tuple(float(x) for x in np.quantile(np.asarray(values, dtype=float), quantiles))


def subset_of(sample: Sample, input_edges: Sequence[float],
              output_edges: Sequence[float]) -> int:
    """Expert index of a sample: input tier x √K + output tier."""
    input_tier = int(np.searchsorted(input_edges, sample.prompt_tokens, side="right"))
    output_tier = int(np.searchsorted(output_edges, sample.output_tokens, side="right"))
    return input_tier * (len(output_edges) + 1) + output_tier


def train_moe(rows: Sequence[Row], featurizer: Featurizer, config: MoEConfig) -> Trained:
    torch.manual_seed(config.seed)
    first_ids, _ = split_halves([r.sample.id for r in rows], config.seed)
    phase1 = [r for r in rows if r.sample.id in first_ids]
    phase2 = [r for r in rows if r.sample.id not in first_ids]
    samples = list({(s.id, s.key): s for s in (r.sample for r in phase1)}.values())
    input_edges = tier_edges([s.prompt_tokens for s in samples], config.tiers)
    output_edges = tier_edges([s.output_tokens for s in samples], config.tiers)
    scale = float(np.mean([r.sample.output_tokens for r in rows if r.generated_tokens == 0]))
    model = MoELength(featurizer.dim, config)
    subsets = [subset_of(r.sample, input_edges, output_edges) for r in phase1]
    sizes = tuple(subsets.count(k) for k in range(config.experts))
    for k, expert in enumerate(model.experts):
        mine = [r for r, s in zip(phase1, subsets, strict=True) if s == k]
        fit(expert, encode(mine, featurizer), targets(mine, scale), config)
    model.experts.requires_grad_(False)  # phase 2 must not move them
    fit_router(model, encode(phase2, featurizer), targets(phase2, scale), config)
    return Trained(model.eval(), scale, input_edges, output_edges, sizes)


def encode(rows: Sequence[Row], featurizer: Featurizer) -> SparseData:
    return SparseData.of([
        featurizer.encode(r.sample.prompt, r.generated_text, r.generated_tokens) for r in rows])


def targets(rows: Sequence[Row], scale: float) -> Tensor:
    return torch.tensor([[r.remaining / scale] for r in rows], dtype=torch.float32)


def fit_router(model: MoELength, data: SparseData, target: Tensor, config: MoEConfig) -> None:
    """Phase 2. The experts are frozen, so their outputs are computed once, not per epoch
    (the same loss and gradients; it makes phase 2 ~10x cheaper)."""
    with torch.no_grad():
        experts = model.expert_outputs(data.batch(torch.arange(len(target))))

    def mixture(batch: SparseBatch, rows: Tensor) -> Tensor:
        gate = torch.softmax(model.router(batch), dim=1)
        return (gate * experts[rows]).sum(dim=1, keepdim=True)

    fit(model.router, data, target, config, forward=mixture)


def fit(net: nn.Module, data: SparseData, target: Tensor, config: MoEConfig,
        forward: Callable[[SparseBatch, Tensor], Tensor] | None = None) -> None:
    """Minibatch Adam on the L1 loss; `forward(batch, rows)` defaults to `net(batch)`."""
    if target.numel() == 0:
        return  # an empty tier: its expert keeps its initial weights (router learns to skip)
    run = forward or (lambda batch, _rows: net(batch))
    optimizers = _optimizers(net, config.lr, config.weight_decay)
    generator = torch.Generator().manual_seed(config.seed)
    net.train()
    for _ in range(config.epochs):
        order = torch.randperm(len(target), generator=generator)
        for start in range(0, len(target), config.batch_size):
            rows = order[start:start + config.batch_size]
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.l1_loss(run(data.batch(rows), rows), target[rows])
            loss.backward()  # type: ignore[no-untyped-call]
            for optimizer in optimizers:
                optimizer.step()
    net.eval()


def _optimizers(net: nn.Module, lr: float,
                weight_decay: float) -> list[torch.optim.Optimizer | RowAdam]:
    """Adam, lazily for the TF-IDF layers (see `RowAdam`)."""
    sparse = [p for m in net.modules() if isinstance(m, nn.EmbeddingBag)
              for p in m.parameters() if p.requires_grad]
    dense = [p for p in net.parameters() if p.requires_grad and all(p is not q for q in sparse)]
    return [torch.optim.AdamW(dense, lr=lr, weight_decay=weight_decay),
            *(RowAdam(p, lr, weight_decay) for p in sparse)]


class RowAdam:
    """Adam that updates only the rows a sparse gradient touches ("lazy" Adam).

    A batch mentions a few hundred of the D TF-IDF terms; a dense Adam step over all
    D x width weights (or torch's SparseAdam, slow on CPU) made each step ~10x slower.
    """

    def __init__(self, param: nn.Parameter, lr: float, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.param, self.lr, self.weight_decay = param, lr, weight_decay
        self.betas, self.eps = betas, eps
        self.mean = torch.zeros_like(param)
        self.square = torch.zeros_like(param)
        self.steps = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        if self.param.grad is None:
            return
        grad = self.param.grad.coalesce()
        rows, values = grad.indices()[0], grad.values()
        beta1, beta2 = self.betas
        self.steps += 1
        mean = self.mean[rows].mul_(beta1).add_(values, alpha=1 - beta1)
        square = self.square[rows].mul_(beta2).addcmul_(values, values, value=1 - beta2)
        self.mean[rows], self.square[rows] = mean, square
        step_size = self.lr / (1 - beta1**self.steps)
        denom = (square / (1 - beta2**self.steps)).sqrt_().add_(self.eps)
        if self.weight_decay:  # decoupled, on the touched rows only (lazy like the rest)
            self.param[rows] *= 1 - self.lr * self.weight_decay
        self.param.index_add_(0, rows, mean / denom, alpha=-step_size)
