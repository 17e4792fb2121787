"""HAN + discrete SAC of qos_drl: graph masking, action masks, learning, checkpoints."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from policies.qos_drl.replay import Replay
from policies.qos_drl.sac import (
    GreedyActor,
    SacAgent,
    SacConfig,
    batch_states,
    load_checkpoint,
    save_checkpoint,
)
from policies.qos_drl.state import ExpertState, GraphState, RequestFeatures, build_state


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)  # as the policy and the trainer run it (2 threads: 15x slower)


def state(load: int, seed: int = 0) -> GraphState:
    rng = np.random.default_rng(seed)
    reqs = tuple(RequestFeatures(int(rng.integers(5, 200)), float(rng.random()), 300.0, 0.01,
                                 int(rng.integers(0, 100)), 0.02) for _ in range(load))
    experts = [ExpertState(0.1 * load, load, 0, reqs, ()), ExpertState(0.0, 0, 0, (), ())]
    return build_state(40, [0.8, 0.3], [200.0, 100.0], experts, limit=0.03)


def test_masked_request_nodes_do_not_change_the_embedding() -> None:
    torch.manual_seed(0)
    agent = SacAgent(SacConfig(n_experts=2))
    g = state(2)
    noisy = GraphState(g.arrived, g.experts, g.running.copy(), g.running_mask, g.waiting,
                       g.waiting_mask)
    noisy.running[0, 3:] = 9.0  # slots 3-4 are padding (mask 0)
    with torch.no_grad():
        a = agent.encoder(batch_states([g]))
        b = agent.encoder(batch_states([noisy]))
        noisy.running[0, 0] = 9.0  # a real node: the embedding must move
        c = agent.encoder(batch_states([noisy]))
    assert torch.allclose(a, b, atol=1e-6)
    assert not torch.allclose(a, c, atol=1e-3)


def test_action_mask_is_respected() -> None:
    torch.manual_seed(0)
    agent = SacAgent(SacConfig(n_experts=2))
    mask = torch.tensor([[False, False, True]])  # no drop, expert 0 missing
    g = batch_states([state(1)])
    assert {agent.act(g, greedy=False, mask=mask)[0] for _ in range(30)} == {2}


@pytest.mark.parametrize("graph", [True, False])
def test_the_onnx_actor_acts_as_the_eager_one(graph: bool) -> None:
    torch.manual_seed(1)
    agent = SacAgent(SacConfig(n_experts=2, graph=graph))
    greedy = GreedyActor(agent)
    masks = [torch.tensor([[True, True, True]]), torch.tensor([[False, True, False]])]
    chosen = set()
    for seed in range(40):
        g, mask = batch_states([state(seed % 6, seed=seed)]), masks[seed % 2]
        with torch.no_grad():
            logits = agent.logits(g, mask)
        action = greedy(g, mask)
        assert action == agent.act(g, greedy=True, mask=mask)[0]
        assert logits[0, action] == logits.max()
        chosen.add(action)
    assert 1 in chosen  # the masked rows force expert 0 at least


def _replay() -> Replay:
    replay = Replay(512, state(1))
    for i in range(256):
        s, a = state(i % 4, seed=i), i % 3
        replay.add(s, a, 1.0 if a == 2 else 0.0, state((i + 1) % 4, seed=i + 1), True)
    return replay


def test_sac_learns_the_rewarded_action() -> None:
    torch.manual_seed(0)
    agent = SacAgent(SacConfig(n_experts=2, graph=False, lr=3e-3))  # MLP: fast enough here
    replay = _replay()
    for _ in range(150):
        agent.update(*replay.sample(64))
    g = batch_states([state(k, seed=1000 + k) for k in range(4)])
    assert agent.act(g, greedy=True) == [2, 2, 2, 2]


def test_han_critic_fits_a_fixed_batch() -> None:
    torch.manual_seed(0)
    agent = SacAgent(SacConfig(n_experts=2, lr=3e-3))
    batch = _replay().sample(32)
    losses = [agent.update(*batch)["critic"] for _ in range(12)]
    assert losses[-1] < 0.5 * losses[0]


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    for graph in (True, False):
        agent = SacAgent(SacConfig(n_experts=2, graph=graph))
        path = tmp_path / f"{graph}.pt"
        save_checkpoint(path, agent, {"experts": ["a", "b"], "steps": 7})
        loaded, meta = load_checkpoint(path)
        g = batch_states([state(3)])
        with torch.no_grad():
            assert torch.equal(agent.logits(g), loaded.logits(g))
        assert meta == {"experts": ["a", "b"], "steps": 7}
        assert loaded.config.graph is graph
