from pathlib import Path
from typing import Any

import pytest
import torch

from predictors.length import train as length_train
from predictors.length.data import Row, arrival_rows, load_samples, samples_for, window_rows
from predictors.length.features import Featurizer
from predictors.length.moe import MoEConfig
from predictors.length.train import RowAdam, split_halves, subset_of, tier_edges, train_moe
from tests.predictors.helpers import counter, sample, write_data

SMALL = MoEConfig(expert_hidden=(16, 8, 8), router_hidden=8, epochs=3, batch_size=32)


def rows_of(tmp_path: Path, key: str = "big-model") -> tuple[list[Row], Featurizer]:
    samples = samples_for(load_samples(write_data(tmp_path / "d.jsonl"), counter()), key)
    rows = arrival_rows(samples) + window_rows(samples, counter(), 10, 2, seed=0)
    return rows, Featurizer.fit([f"{s.prompt}\n{s.output}" for s in samples])


def test_training_is_deterministic(tmp_path: Path) -> None:
    rows, featurizer = rows_of(tmp_path)
    first = train_moe(rows, featurizer, SMALL).model.state_dict()
    second = train_moe(rows, featurizer, SMALL).model.state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_tiers_are_quantiles_and_subsets_are_the_grid() -> None:
    assert tier_edges(list(range(1, 10)), 3) == pytest.approx((3.667, 6.333), abs=1e-3)
    edges = (10.0, 20.0)
    assert subset_of(sample(0, 5, 5), edges, edges) == 0
    assert subset_of(sample(0, 5, 25), edges, edges) == 2
    assert subset_of(sample(0, 15, 15), edges, edges) == 4
    assert subset_of(sample(0, 25, 5), edges, edges) == 6
    assert subset_of(sample(0, 25, 25), edges, edges) == 8
    assert MoEConfig().tiers == 3
    with pytest.raises(ValueError):
        _ = MoEConfig(experts=8).tiers


def test_halves_split_prompt_ids_disjointly() -> None:
    first, second = split_halves([3, 1, 2, 2, 4, 5, 6, 6], seed=0)
    assert first.isdisjoint(second) and first | second == {1, 2, 3, 4, 5, 6}
    assert len(first) == 3 and split_halves([6, 5, 4, 3, 2, 1], seed=0) == (first, second)


def test_each_expert_learns_only_its_tier_from_phase_one(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Phase 1 gives expert k exactly the phase-1 rows of grid cell k; phase 2 the rest."""
    seen: list[tuple[Any, int]] = []
    real_fit = length_train.fit

    def spy(net: Any, data: Any, target: torch.Tensor, config: MoEConfig, **kw: Any) -> None:
        seen.append((net, len(target)))
        real_fit(net, data, target, config, **kw)

    monkeypatch.setattr(length_train, "fit", spy)
    rows, featurizer = rows_of(tmp_path)
    trained = train_moe(rows, featurizer, SMALL)
    first_ids, _ = split_halves([r.sample.id for r in rows], SMALL.seed)
    phase1 = [r for r in rows if r.sample.id in first_ids]
    cells = [subset_of(r.sample, trained.input_edges, trained.output_edges) for r in phase1]
    expected = [cells.count(k) for k in range(9)]
    experts = [(net, n) for net, n in seen if net is not trained.model.router]
    assert [net for net, _ in experts] == list(trained.model.experts)
    assert [n for _, n in experts] == expected
    assert trained.subset_sizes == tuple(expected)
    assert seen[-1] == (trained.model.router, len(rows) - len(phase1))


def test_phase_two_leaves_experts_untouched(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    snapshots: list[dict[str, torch.Tensor]] = []
    real = length_train.fit_router

    def spy(model: Any, *args: Any) -> None:
        snapshots.append({k: v.clone() for k, v in model.experts.state_dict().items()})
        router_before = [p.clone() for p in model.router.parameters()]
        real(model, *args)
        assert any(not torch.equal(a, b) for a, b in
                   zip(router_before, model.router.parameters(), strict=True))

    monkeypatch.setattr(length_train, "fit_router", spy)
    rows, featurizer = rows_of(tmp_path)
    trained = train_moe(rows, featurizer, SMALL)
    after = trained.model.experts.state_dict()
    assert all(torch.equal(snapshots[0][k], after[k]) for k in after)
    assert not any(p.requires_grad for p in trained.model.experts.parameters())


def test_row_adam_is_adam_when_every_row_is_touched() -> None:
    torch.manual_seed(0)
    lazy = torch.nn.Parameter(torch.randn(4, 3))
    dense = torch.nn.Parameter(lazy.detach().clone())
    lazy_opt, dense_opt = RowAdam(lazy, 0.1), torch.optim.Adam([dense], lr=0.1)
    for step in range(5):
        grad = torch.randn(4, 3) * (step + 1)
        lazy.grad = grad.to_sparse(sparse_dim=1)  # as EmbeddingBag makes them
        dense.grad = grad.clone()
        lazy_opt.step()
        dense_opt.step()
    assert torch.allclose(lazy, dense, atol=1e-6)
