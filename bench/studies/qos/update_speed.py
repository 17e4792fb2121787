"""What a qos_drl training step costs (issue 8, point 4: how many decisions fit): one
discrete-SAC update (batch 32, the trainer's) and one sampled action, on states of the
simulator, with the HAN packed (`policies.qos_drl.han`: the present request nodes only) and
dense over every request slot (`bench.studies.qos.han_dense`, as until 2026-11-27), the same
agent and batches, timed in alternating rounds in one process, one thread.

States: the paper's edge (`--fleet`), λ = 5, training prompts, routed by the agent of
`--checkpoint` when it exists (sampled actions, as in training), else uniformly.

    python -m bench.studies.qos.update_speed [--fleet paper] [--checkpoint …/best.pt]
        [--states 2000] [--rounds 5] [--out docs/results/qos_drl/update_speed.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from bench.harness.report import git_commit
from bench.harness.results import write_json
from bench.studies.qos.han_dense import DenseHAN
from bench.studies.qos.setup import fleet, fleet_meta, load_pools, trained_fleet
from bench.studies.qos.sim import QosSim
from policies.qos_drl.sac import SacAgent, SacConfig, batch_states, load_checkpoint
from policies.qos_drl.state import GraphState
from predictors.buckets.cli import default_artifact
from predictors.home import ALPACA_EVAL, laneway_home

T = TypeVar("T")
Batch = tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict[str, torch.Tensor],
              torch.Tensor]


def simulated_states(args: argparse.Namespace) -> tuple[list[GraphState], str]:
    experts, pool, _, _ = load_pools(args.data, args.buckets)
    mapping, cores, solo = trained_fleet(fleet_meta(args.fleet))
    sim = QosSim(fleet(experts, mapping), pool, args.rate, args.limit_ms / 1000,
                 seed=args.seed, cores=cores, solo=solo)
    router: Callable[[GraphState], int]
    if args.checkpoint.exists():
        agent, _ = load_checkpoint(args.checkpoint)
        router, routed_by = (lambda s: agent.act(batch_states([s]), greedy=False)[0],
                             str(args.checkpoint))
    else:
        rng = random.Random(args.seed)
        router, routed_by = (lambda s: rng.randrange(1, len(experts) + 1),
                             "uniform over the experts")
    sim.arrive()
    states = [sim.state()]
    while len(states) < args.states:
        sim.route(router(states[-1]))
        sim.arrive()
        sim.take_completed()
        states.append(sim.state())
    return states, routed_by


def batches(states: list[GraphState], count: int, size: int, n_actions: int,
            seed: int) -> list[Batch]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        s, s2 = (batch_states([states[i] for i in rng.integers(0, len(states), size)])
                 for _ in range(2))
        out.append((s, torch.from_numpy(rng.integers(0, n_actions, size)),
                    torch.from_numpy(rng.random(size, dtype=np.float32)), s2,
                    torch.zeros(size)))
    return out


def dense(agent: SacAgent) -> SacAgent:
    """The agent with its online and target HANs computing densely (same parameters)."""
    for encoder in (agent.encoder, agent.target[0]):
        encoder.han.__class__ = DenseHAN
    return agent


def _update(agent: SacAgent, batch: Batch) -> None:
    agent.update(*batch)


def _act(agent: SacAgent, state: dict[str, torch.Tensor]) -> None:
    agent.act(state, greedy=False)


def mean_ms(call: Callable[[T], object], items: Sequence[T]) -> float:
    start = time.perf_counter()
    for item in items:
        call(item)
    return 1000 * (time.perf_counter() - start) / len(items)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ALPACA_EVAL)
    parser.add_argument("--buckets", type=Path, default=default_artifact())
    parser.add_argument("--fleet", choices=("gpu", "paper", "tiny"), default="paper")
    parser.add_argument("--checkpoint", type=Path,
                        default=laneway_home() / "policies" / "qos-drl-paper-1m" / "best.pt")
    parser.add_argument("--rate", type=float, default=5.0)
    parser.add_argument("--limit-ms", type=float, default=30.0)
    parser.add_argument("--states", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    states, routed_by = simulated_states(args)
    n = states[0].experts.shape[0]
    work = batches(states, args.batches, args.batch, n + 1, args.seed)
    singles = [batch_states([s]) for s in states[:500]]
    agents = {}
    for kind in ("packed", "dense"):
        torch.manual_seed(args.seed)
        agent = SacAgent(SacConfig(n_experts=n))
        agents[kind] = dense(agent) if kind == "dense" else agent
    times: dict[str, dict[str, list[float]]] = {k: {"update": [], "act": []} for k in agents}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for kind, agent in agents.items():
            update = mean_ms(partial(_update, agent), work)
            act = mean_ms(partial(_act, agent), singles)
            if round_:
                times[kind]["update"].append(update)
                times[kind]["act"].append(act)
    fill = {kind: float(np.mean([getattr(s, f"{kind}_mask").mean() for s in states]))
            for kind in ("running", "waiting")}
    median = {kind: {op: statistics.median(v) for op, v in ops.items()}
              for kind, ops in times.items()}
    result: dict[str, Any] = {
        "update_ms": {k: round(v["update"], 2) for k, v in median.items()},
        "act_ms": {k: round(v["act"], 3) for k, v in median.items()},
        "update_speedup": round(median["dense"]["update"] / median["packed"]["update"], 2),
        "act_speedup": round(median["dense"]["act"] / median["packed"]["act"], 2),
        "slot_fill": {k: round(v, 3) for k, v in fill.items()},
        "rounds": times, "states": len(states), "routed_by": routed_by, "fleet": args.fleet,
        "batch": args.batch, "batches": args.batches, "threads": 1,
        "command": " ".join(["python -m bench.studies.qos.update_speed", *sys.argv[1:]]),
        "commit": git_commit()}
    print(f"SAC update (batch {args.batch}): packed {result['update_ms']['packed']} ms, "
          f"dense {result['update_ms']['dense']} ms ({result['update_speedup']}x); "
          f"sampled action: packed {result['act_ms']['packed']} ms, dense "
          f"{result['act_ms']['dense']} ms; slots filled {fill['running']:.0%} running, "
          f"{fill['waiting']:.0%} waiting")
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
