"""`python -m bench train qos-drl`: discrete SAC on the simulator (issue 8, point 4).

Episodes of `--episode` Poisson arrivals (λ = `--rate`, the paper's 5/s) over the
training prompts; after `--warmup` random actions, one SAC update per decision.
Every `--eval-every` steps the greedy agent runs on the held-out prompts; the best
is kept (the paper: "save the models that achieve the best evaluation results"),
the latest too, and a learning curve PNG is drawn. `--baseline` trains the paper's
Baseline RL instead (expert-level MLP, completed-QoS reward). `--reward completed`
without `--baseline` is the paper's ablation "Baseline RL + DSA" (§VI-C, Fig. 17): the
HAN state with Baseline RL's reward.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench.studies.qos.evaluate import agent_router, evaluate
from bench.studies.qos.setup import fleet, fleet_meta, load_pools, trained_fleet
from bench.studies.qos.sim import QosSim
from policies.qos_drl.impact import reward
from policies.qos_drl.replay import Replay
from policies.qos_drl.sac import SacAgent, SacConfig, batch_states, save_checkpoint
from predictors.home import laneway_home


def default_dir(baseline: bool) -> Path:
    return laneway_home() / "policies" / ("qos-baseline-rl-v1" if baseline else "qos-drl-v1")


def default_checkpoint(baseline: bool) -> Path:
    """The best checkpoint `python -m bench train qos-drl [--baseline]` writes by default."""
    return default_dir(baseline) / "best.pt"


def existing_checkpoint(value: str) -> Path:
    """An argparse type: a checkpoint file that is there (argparse also runs it on the
    defaults, given as strings), else a usage error that says how to make one."""
    path = Path(value)
    if not path.is_file():
        raise argparse.ArgumentTypeError(
            f"no checkpoint at {path}: train the agents with `make train-qos-drl` "
            "(`python -m bench train qos-drl [--baseline]`) or name another")
    return path


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    """`--checkpoint` (qos_drl) and `--baseline-checkpoint` (Baseline RL) of a comparison."""
    parser.add_argument("--checkpoint", type=existing_checkpoint,
                        default=str(default_checkpoint(False)))
    parser.add_argument("--baseline-checkpoint", type=existing_checkpoint,
                        default=str(default_checkpoint(True)))


def paper_reward(baseline: bool) -> str:
    """The paper's pairing: Eq. 16 for qos_drl, the completed QoS for Baseline RL."""
    return "completed" if baseline else "qos-aware"


def reward_of(args: argparse.Namespace) -> str:
    """`--reward`, or the paper's pairing when not given."""
    return str(getattr(args, "reward", None) or paper_reward(args.baseline))


def checkpoint_reward(meta: dict[str, Any]) -> str:
    """The reward a checkpoint was trained on (before `--reward`: the paper's pairing)."""
    return str(meta.get("reward") or paper_reward(bool(meta.get("baseline"))))


def agent_title(baseline: bool, reward_name: str) -> str:
    """What a run trains, by the paper's names (§VI-C)."""
    if baseline:
        return "Baseline RL" + (" + QoS-aware reward" if reward_name == "qos-aware" else "")
    if reward_name == "completed":
        return "Baseline RL + DSA (HAN + discrete SAC, completed-QoS reward)"
    return "qos_drl (HAN + discrete SAC)"


def _progress(step: int, first: int, total: int, started: float, note: str) -> None:
    """The bar at `step` of `total`; the rate counts this run's steps (from `first`)."""
    done = step / total
    bar = "#" * int(30 * done)
    rate = (step - first) / max(1e-9, time.monotonic() - started)
    sys.stderr.write(f"\r[{bar:<30}] {step}/{total} {rate:.0f} steps/s {note}")
    sys.stderr.flush()


def train(args: argparse.Namespace) -> int:
    import torch

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    experts, train_pool, heldout, source = load_pools(args.data, args.buckets,
                                                      estimate=args.bucket_estimate)
    hardware = fleet_meta(args.fleet)
    mapping, cores, solo = trained_fleet(hardware)  # as evaluations will read it back
    specs, limit = fleet(experts, mapping), args.limit_ms / 1000
    # domain randomization (off by default): each episode on a machine up to
    # 1 + jitter times slower than --speed, as live runs found this one; the speeds
    # have their own generator, apart from the arrivals'
    jitter = random.Random(args.seed + 2)

    def episode_speed() -> float:
        return float(args.speed) * (1.0 + jitter.uniform(0.0, args.speed_jitter))

    sim = QosSim(specs, train_pool, args.rate, limit, seed=args.seed, cores=cores, solo=solo,
                 speed=episode_speed())
    eval_sim = QosSim(specs, heldout, args.rate, limit, seed=args.seed + 1, cores=cores,
                      solo=solo, speed=args.speed)
    agent = SacAgent(SacConfig(n_experts=len(experts), graph=not args.baseline))
    sim.arrive()
    state = sim.state()
    replay = Replay(args.buffer, state, args.seed)
    curve: dict[str, list[Any]] = {"step": [], "episode_reward": [], "episode_speed": [],
                                   "eval_step": [], "eval_qos": []}
    best, episode_reward, in_episode = -1.0, 0.0, 0
    meta = {"update_every": args.update_every, "batch": args.batch, "experts": experts,
            **hardware, "speed": args.speed, "speed_jitter": args.speed_jitter,
            "k": {s.name: [s.k.k1, s.k.k2] for s in specs}, "rate": args.rate,
            "limit_ms": args.limit_ms, "predictions": source,
            "bucket_estimate": args.bucket_estimate, "baseline": args.baseline,
            "reward": reward_of(args)}
    step = resume(args, agent, curve, meta)
    reward_name = meta["reward"]  # a resumed run goes on with the reward it began with
    if args.resume and (args.out / "best.pt").exists():
        best = float(torch.load(args.out / "best.pt", weights_only=True)["meta"]["eval_qos"])
    top = TopCheckpoints(args.out / "top", args.keep_best, args.resume)
    first, started = step, time.monotonic()
    while step < args.steps and time.monotonic() - started < args.minutes * 60:
        step += 1
        if step <= first + args.warmup and not args.resume:
            action = sim.rng.randrange(len(experts) + 1)
        else:
            action = agent.act(batch_states([state]), greedy=False)[0]
        penalty = sim.route(action)
        sim.arrive()
        r = reward(sim.take_completed(), penalty, qos_aware=reward_name == "qos-aware")
        in_episode += 1
        done = in_episode >= args.episode
        next_state = sim.state()
        replay.add(state, action, r, next_state, done)
        episode_reward += r
        state = next_state
        if done:
            curve["step"].append(step)
            curve["episode_reward"].append(episode_reward)
            curve["episode_speed"].append(sim.speed)
            episode_reward, in_episode = 0.0, 0
            sim.speed = episode_speed()
            sim.reset()
            sim.arrive()
            state = sim.state()
        if step > first + args.warmup and step % args.update_every == 0:
            agent.update(*replay.sample(args.batch))
        if step % args.eval_every == 0:
            result = evaluate(eval_sim, agent_router(agent), args.eval_arrivals)
            curve["eval_step"].append(step)
            curve["eval_qos"].append(result.avg_qos)
            meta.update(steps=step, train_s=round(time.monotonic() - started, 1))
            save_checkpoint(args.out / "last.pt", agent, meta)
            (args.out / "curve.json").write_text(json.dumps({**curve, "meta": meta}) + "\n")
            if result.avg_qos > best:
                best = result.avg_qos
                save_checkpoint(args.out / "best.pt", agent, {**meta, "eval_qos": best})
            top.offer(agent, {**meta, "eval_qos": result.avg_qos})
        if step % 50 == 0:
            _progress(step, first, args.steps, started, f"best eval QoS {best:.3f}")
    meta.update(steps=step, train_s=round(time.monotonic() - started, 1), best_eval_qos=best)
    save_checkpoint(args.out / "last.pt", agent, meta)
    (args.out / "curve.json").write_text(json.dumps({**curve, "meta": meta}) + "\n")
    plot_curve(curve, args.out / "learning_curve.png", agent_title(args.baseline, reward_name))
    print(f"\ntrained {step} steps in {meta['train_s']} s; best held-out QoS {best:.3f}; "
          f"wrote {args.out}")
    return 0


class TopCheckpoints:
    """With `--keep-best K`: the K checkpoints with the highest held-out evaluations so
    far, as top/step-NNNNNNN.pt, for a larger evaluation to pick among
    (`python -m bench.studies.qos.select`). A resumed run goes on from what the directory holds;
    a new one in the same place removes it (as it overwrites best.pt and last.pt)."""

    def __init__(self, directory: Path, keep: int, resume: bool = False) -> None:
        import torch

        self.directory, self.keep = directory, keep
        self.kept: dict[Path, float] = {}
        for path in directory.glob("step-*.pt"):
            if resume:
                self.kept[path] = float(torch.load(path, weights_only=True)["meta"]["eval_qos"])
            else:
                path.unlink()

    def offer(self, agent: SacAgent, meta: dict[str, Any]) -> None:
        """`meta` has the evaluation's `eval_qos` and the `steps`."""
        qos = float(meta["eval_qos"])
        if self.keep <= 0 or (len(self.kept) >= self.keep and qos <= min(self.kept.values())):
            return
        path = self.directory / f"step-{meta['steps']:07d}.pt"
        save_checkpoint(path, agent, meta)
        self.kept[path] = qos
        while len(self.kept) > self.keep:
            evicted = min(self.kept, key=lambda p: self.kept[p])
            del self.kept[evicted]
            evicted.unlink()


def resume(args: argparse.Namespace, agent: SacAgent, curve: dict[str, list[Any]],
           meta: dict[str, Any]) -> int:
    """Continue a run (`--resume`): weights, curve and step count of its last.pt (the
    optimizer state and replay buffer start afresh; actions come from the agent), and
    the reward it was trained on unless `--reward` names another, which is refused."""
    if not args.resume:
        return 0
    import torch

    blob = torch.load(args.out / "last.pt", weights_only=True)
    trained_on = checkpoint_reward(blob["meta"])
    asked = getattr(args, "reward", None)
    if asked is not None and asked != trained_on:
        raise SystemExit(f"python -m bench train qos-drl: {args.out} was trained on the "
                         f"{trained_on} "
                         f"reward; --resume with --reward {asked} would change it mid-run")
    meta["reward"] = trained_on
    agent.load_state_dict(blob["state"])
    saved = json.loads((args.out / "curve.json").read_text())
    for key in curve:
        curve[key].extend(saved.get(key, []))  # episode_speed: not before the option
    meta["resumed_at"] = int(blob["meta"]["steps"])
    meta["train_s_before"] = blob["meta"].get("train_s")
    return int(blob["meta"]["steps"])


def plot_curve(curve: dict[str, list[Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(curve["step"], curve["episode_reward"], lw=0.8)
    top.set_ylabel("episode reward")
    bottom.plot(curve["eval_step"], curve["eval_qos"], marker=".")
    bottom.set_ylabel("held-out avg QoS (greedy)")
    bottom.set_xlabel("training steps (decisions)")
    top.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
