"""`python -m bench train qos-drl` arguments; the trainer (torch) loads only when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_train(train_parsers: Any) -> None:
    from predictors.base import BUCKET_ESTIMATES
    from predictors.buckets.cli import default_artifact
    from predictors.home import ALPACA_EVAL

    p = train_parsers.add_parser("qos-drl", help="HAN + discrete SAC router (qos_drl)")
    p.add_argument("--data", type=Path, default=ALPACA_EVAL)
    p.add_argument("--buckets", type=Path, default=default_artifact(),
                   help="bucket predictor artifact (missing: oracle buckets)")
    p.add_argument("--bucket-estimate", choices=BUCKET_ESTIMATES, default="midpoint",
                   help="the value the agent sees of each predicted bucket distribution: "
                   "the most likely bucket's midpoint (the paper) or the probability-"
                   "weighted mean (a deviation; recorded in the checkpoint, which the "
                   "policy and the benchmarks then read with the same estimate)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--baseline", action="store_true", help="train Baseline RL instead")
    p.add_argument("--reward", choices=("qos-aware", "completed"), default=None,
                   help="the reward trained on: qos-aware (Eq. 16: completed QoS minus the "
                   "action impact estimate) or completed (Baseline RL's: completed QoS "
                   "only); default: qos-aware, completed with --baseline. qos_drl's "
                   "state with --reward completed is the paper's ablation \"Baseline RL + "
                   "DSA\" (§VI-C, Fig. 17)")
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--minutes", type=float, default=20.0, help="wall-clock budget")
    p.add_argument("--fleet", choices=("gpu", "paper", "tiny"), default="gpu",
                   help="the simulated experts' hardware: gpu "
                   "(bench.studies.qos.setup.DEFAULT_FLEET: "
                   "mixed GPUs, every expert as Llama-3.1-8B), paper (PAPER_FLEET: every "
                   "expert's own model on an RTX 4090 of its own, the paper's edge) or tiny "
                   "(the vLLM-CPU tiny models of `bench.studies.qos.live --fleet real`, sharing "
                   "this "
                   "machine's cores; use with a smaller --rate and --limit-ms)")
    p.add_argument("--rate", type=float, default=5.0, help="λ, arrivals per second")
    p.add_argument("--limit-ms", type=float, default=30.0, help="L, latency per token")
    p.add_argument("--speed", type=float, default=1.0, metavar="S",
                   help="every engine step lasts S times the fitted model's, in training and "
                   "in the held-out evaluations that pick the best checkpoint (S < 1: a "
                   "machine faster than the fit; `bench.studies.qos.headroom --speed`)")
    p.add_argument("--speed-jitter", type=float, default=0.0, metavar="J",
                   help="each training episode on a machine 1 to 1 + J times slower than "
                   "--speed, drawn uniformly (domain randomization; the held-out "
                   "evaluations stay at --speed)")
    p.add_argument("--episode", type=int, default=400, help="arrivals per episode")
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--update-every", type=int, default=4, help="decisions per SAC update")
    p.add_argument("--buffer", type=int, default=100_000)
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--eval-arrivals", type=int, default=300)
    p.add_argument("--keep-best", type=int, default=0, metavar="K",
                   help="also keep the K best-evaluated checkpoints in OUT/top/ for "
                   "python -m bench.studies.qos.select to pick among on a larger evaluation")
    p.add_argument("--resume", action="store_true", help="continue from --out's last.pt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from bench.studies.qos.train import default_dir, train

    args.out = args.out or default_dir(args.baseline)
    return train(args)
