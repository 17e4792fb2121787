"""The packed HAN (present request nodes only) against the HAN written densely over
every slot with masks (`bench.studies.qos.han_dense`): same weights, same embeddings and
gradients."""

from __future__ import annotations

import numpy as np
import torch

from bench.studies.qos.han_dense import forward as dense_han
from policies.qos_drl.han import HAN
from policies.qos_drl.sac import batch_states
from policies.qos_drl.state import ExpertState, RequestFeatures, build_state


def states(count: int) -> dict[str, torch.Tensor]:
    """Mixed fills: empty queues, full ones (5 of more), waiting requests, idle experts."""
    rng = np.random.default_rng(3)

    def queue(size: int) -> tuple[RequestFeatures, ...]:
        return tuple(RequestFeatures(int(rng.integers(5, 400)), float(rng.random()),
                                     float(rng.integers(10, 600)), float(rng.random() / 10),
                                     int(rng.integers(0, 200)), float(rng.random() / 20))
                     for _ in range(size))

    out = []
    for _ in range(count):
        experts = []
        for _ in range(4):
            running, waiting = int(rng.integers(0, 8)), int(rng.integers(0, 3)) * 3
            experts.append(ExpertState(float(rng.random()), running, waiting,
                                       queue(running), queue(waiting)))
        out.append(build_state(int(rng.integers(5, 400)), list(rng.random(4)),
                               list(rng.integers(10, 600, 4).astype(float)), experts, 0.03))
    return batch_states(out)


def test_packed_han_equals_the_dense_one_with_its_gradients() -> None:
    torch.manual_seed(0)
    han = HAN(1 + 2 * 4, 3 + 4, 6, hidden=32, heads=4, layers=2)
    g = states(16)
    assert 0 < float(g["running_mask"].mean()) < 1 and float(g["waiting_mask"].sum()) > 0
    packed, dense = han(g), dense_han(han, g)
    for p, d in zip(packed, dense, strict=True):
        assert torch.allclose(p, d, atol=1e-5)
    grads = []
    for a, e in (packed, dense):
        han.zero_grad()
        (a.square().sum() + e.sin().sum()).backward()  # type: ignore[no-untyped-call]
        grads.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                      for p in han.parameters()])
    for p, d in zip(*grads, strict=True):
        assert torch.allclose(p, d, atol=1e-5)


def test_a_graph_without_request_nodes() -> None:
    torch.manual_seed(0)
    han = HAN(1 + 2 * 4, 3 + 4, 6, hidden=32, heads=4, layers=2)
    g = states(4)
    for kind in ("running", "waiting"):
        g[f"{kind}_mask"].zero_()
    for p, d in zip(han(g), dense_han(han, g), strict=True):
        assert torch.allclose(p, d, atol=1e-5)
