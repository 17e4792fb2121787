"""Pick a qos_drl training run's checkpoint on a larger held-out evaluation.

The trainer keeps the checkpoint whose 300-arrival evaluation came out highest (the
paper: "save the models that achieve the best evaluation results"), but one such
evaluation swings by ±0.05 around its neighbours', so the best of hundreds is partly
the luckiest (docs/qos_drl.md, "Toward the paper's 1 M decisions"). This evaluates
every candidate of a run (`top/*.pt` from `python -m bench train qos-drl --keep-best K`, and
`best.pt`, `last.pt`) greedily on `--seeds` draws of `--arrivals` held-out arrivals at
the λ, latency limit, fleet and speed the run was trained on, and copies the one with
the highest mean QoS to RUN/selected.pt; RUN/selection.json has every candidate's
figures. The draws' seeds differ from the trainer's (1) and the benches' (7-12).

    python -m bench.studies.qos.select RUN [--arrivals 600] [--seeds 101 102 103 104]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any, NamedTuple

from bench.harness.report import git_commit
from bench.harness.results import write_json
from bench.studies.qos.evaluate import agent_router, evaluate
from bench.studies.qos.setup import comparison
from bench.studies.qos.sim import QosSim
from policies.qos_drl.sac import SacAgent, load_checkpoint
from predictors.buckets.cli import default_artifact
from predictors.home import ALPACA_EVAL


class Candidate(NamedTuple):
    path: Path
    agent: SacAgent
    meta: dict[str, Any]


def candidates(run: Path) -> list[Candidate]:
    """The run's kept checkpoints, loaded, one per training step in step order (best.pt
    is often a top one)."""
    by_step: dict[int, Candidate] = {}
    for path in [*sorted((run / "top").glob("step-*.pt")), run / "best.pt", run / "last.pt"]:
        if path.exists():
            agent, meta = load_checkpoint(path)
            by_step.setdefault(int(meta["steps"]), Candidate(path, agent, meta))
    return [by_step[step] for step in sorted(by_step)]


def select(args: argparse.Namespace) -> dict[str, Any]:
    loaded = candidates(args.run)
    if not loaded:
        raise SystemExit(f"{args.run}: no checkpoints (best.pt, last.pt or top/*.pt)")
    meta = loaded[0].meta
    # one run: its fleet and bucket estimate on both sides
    (_, cores, solo), specs, heldout, source = comparison(args.data, args.buckets, meta, meta)
    sims = [QosSim(specs, heldout, float(meta["rate"]), float(meta["limit_ms"]) / 1000,
                   seed=seed, cores=cores, solo=solo, speed=float(meta.get("speed", 1.0)))
            for seed in args.seeds]
    rows, means = [], []
    for path, agent, own in loaded:
        qos = [evaluate(sim, agent_router(agent), args.arrivals).avg_qos for sim in sims]
        name = path.name if path.parent == args.run else f"{path.parent.name}/{path.name}"
        means.append(statistics.fmean(qos))
        rows.append({"checkpoint": name, "steps": int(own["steps"]),
                     "train_eval_qos": own.get("eval_qos"), "qos": qos,
                     "mean_qos": means[-1]})
        trainer = "—" if own.get("eval_qos") is None else f"{own['eval_qos']:.3f}"
        print(f"{name:22s} step {own['steps']:>7} trainer's evaluation {trainer:>5}  "
              f"mean over {len(qos)} draws {means[-1]:.3f}", flush=True)
    chosen = means.index(max(means))
    shutil.copyfile(loaded[chosen].path, args.run / "selected.pt")
    return {"run": str(args.run), "selected": rows[chosen], "candidates": rows,
            "arrivals": args.arrivals, "seeds": args.seeds, "rate": meta["rate"],
            "predictions": source,
            "command": " ".join(["python -m bench.studies.qos.select", *sys.argv[1:]]),
            "commit": git_commit()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a `python -m bench train qos-drl --out` directory")
    parser.add_argument("--data", type=Path, default=ALPACA_EVAL)
    parser.add_argument("--buckets", type=Path, default=default_artifact(),
                        help="the predictor the trainer evaluated with (its default)")
    parser.add_argument("--arrivals", type=int, default=600)
    parser.add_argument("--seeds", type=int, nargs="+", default=[101, 102, 103, 104])
    args = parser.parse_args(argv)
    result = select(args)
    write_json(args.run / "selection.json", result)
    chosen = result["selected"]
    print(f"selected {chosen['checkpoint']} (step {chosen['steps']}, mean QoS "
          f"{chosen['mean_qos']:.3f}) → {args.run / 'selected.pt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
