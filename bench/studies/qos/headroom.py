"""How much average QoS is there to gain over Baseline RL in the qos_drl simulator?
(issue 8, diagnosis of the ≥ 30 % target).

Beside qos_drl and Baseline RL, on the same fleet, arrivals and held-out prompts as
`bench.studies.qos.bench_qos`, two routers that know more than any deployable one:

* `lookahead_oracle`: for each arrival, every expert is tried on a copy of the
  simulator (`QosSim.what_if`), which runs everything in the fleet to completion with no
  further arrivals; the expert with the largest total φ of those requests wins. It
  knows every request's true score and answer length on every expert and the exact
  latency model: a one-step clairvoyant greedy, not an optimum (it ignores the
  requests still to come), but far better informed than the paper's agent.
* `lookahead_predicted_score`: the same, judging each outcome by the bucket
  predictor's score (what a router can know of quality) * 1[latency per token ≤ L],
  still with the true lengths and latency model.

Neither is a policy laneway could deploy; they bound what better routing could buy
here. If the clairvoyant one barely clears +30 % over Baseline RL, an agent that sees
predicted buckets cannot be expected to.

`--oracle-buckets score|length` hands every router the true buckets for that half only
(which half of the predictor's error costs QoS); `--speed s` runs the fleet on a
machine s times slower than the fit (`QosSim(speed=…)`; s < 1: faster), for agents
trained with or without `python -m bench train qos-drl --speed` / `--speed-jitter`. `--seeds`
averages every router over the held-out arrivals of several seeds (one seed's draw of
600 moves a router's QoS by a few per cent).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.harness.results import write_json
from bench.studies.qos.bench_qos import add_simulator_arguments
from bench.studies.qos.evaluate import Router, agent_router, evaluate
from bench.studies.qos.setup import comparison
from bench.studies.qos.sim import QosSim, SimRequest
from policies.qos_drl.sac import load_checkpoint
from predictors.home import REPO

RESULTS = REPO / "docs" / "results"
Judge = Callable[[SimRequest, float], float]  # (finished request, L) -> its value


def true_qos(req: SimRequest, limit: float) -> float:
    return req.qos or 0.0


def predicted_qos(req: SimRequest, limit: float) -> float:
    """φ with the bucket predictor's score in place of the judge's."""
    if req.expert < 0 or req.latency_per_token is None:
        return 0.0
    return req.prompt.pred_scores[req.expert] * (req.latency_per_token <= limit)


def lookahead(judge: Judge) -> Router:
    """The expert whose `what_if` finishes the fleet's requests with the most value
    (the first on ties; never a drop: a drop cannot add value)."""
    def route(sim: QosSim) -> int:
        values = [sum(judge(r, sim.limit) for r in sim.what_if(action))
                  for action in range(1, len(sim.experts) + 1)]
        return 1 + max(range(len(values)), key=lambda n: (values[n], -n))

    return route


def mean_result(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's `EvalResult` fields as they are; several runs' means (lists element by
    element), with every run's avg_qos in `avg_qos_per_seed`."""
    if len(results) == 1:
        return results[0]
    mean: dict[str, Any] = {}
    for key, first in results[0].items():
        values = [r[key] for r in results]
        mean[key] = [sum(v) / len(v) for v in zip(*values, strict=True)] \
            if isinstance(first, list) else sum(values) / len(values)
    mean["arrivals"] = sum(r["arrivals"] for r in results)
    return mean | {"avg_qos_per_seed": [r["avg_qos"] for r in results]}


def previous_table(out: Path, setup: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The rows already in `out` when it was made with the same setup (so runs with
    `--only` or other `--rates` add to it); else none."""
    if not out.exists():
        return {}
    previous = json.loads(out.read_text())
    if any(previous.get(key) != value for key, value in setup.items()):
        return {}
    table: dict[str, dict[str, Any]] = previous.get("table", {})
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_simulator_arguments(parser)  # bench.studies.qos.bench_qos's, with its defaults
    parser.add_argument("--oracle-buckets", nargs="?", const="both",
                        choices=("both", "score", "length"), default=None,
                        help="give every router the midpoints of the true score and "
                        "length buckets instead of --buckets' predictions (score or "
                        "length: only that half, the other still --buckets')")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="run the held-out arrivals of each of these seeds (instead of "
                        "--seed's alone) and report each router's mean over them")
    parser.add_argument("--only", nargs="+", default=None, metavar="ROUTER")
    parser.add_argument("--out", type=Path, default=RESULTS / "qos_headroom.json")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    qos_agent, qos_meta = load_checkpoint(args.checkpoint)
    baseline_agent, baseline_meta = load_checkpoint(args.baseline_checkpoint)
    both = args.oracle_buckets == "both"
    buckets = None if both else args.buckets  # None: the true buckets
    part = None if both else args.oracle_buckets
    trained, specs, heldout, source = comparison(
        args.data, buckets, qos_meta, baseline_meta, args.bucket_estimate, oracle=part)
    limit = qos_meta.get("limit_ms", 30.0) / 1000
    routers: dict[str, Router] = {
        "baseline_rl": agent_router(baseline_agent), "qos_drl": agent_router(qos_agent),
        "lookahead_oracle": lookahead(true_qos),
        "lookahead_predicted_score": lookahead(predicted_qos)}
    seeds = args.seeds or [args.seed]
    setup = {"fleet": trained.mapping, "cores": trained.cores, "solo_slowdown": trained.solo,
             "speed": args.speed, "limit_ms": limit * 1000, "arrivals": args.arrivals,
             "seed": seeds[0] if len(seeds) == 1 else seeds,
             "predictions": source, "checkpoint": str(args.checkpoint),
             "baseline_checkpoint": str(args.baseline_checkpoint)}
    table = previous_table(args.out, setup)
    for rate in args.rates:
        sims = [QosSim(specs, heldout, rate, limit, seed=seed,
                       cores=trained.cores, solo=trained.solo, speed=args.speed)
                for seed in seeds]
        row = table.setdefault(f"{rate:g}", {})
        for name, router in routers.items():
            if args.only and name not in args.only:
                continue
            started = time.perf_counter()
            row[name] = mean_result([asdict(evaluate(sim, router, args.arrivals))
                                     for sim in sims])
            row[name]["seconds"] = round(time.perf_counter() - started, 1)
            print(f"λ={rate:g} {name:26s} QoS {row[name]['avg_qos']:.3f} "
                  f"({row[name]['seconds']:.0f} s)", flush=True)
        base = row.get("baseline_rl", {}).get("avg_qos")
        for result in row.values():
            result["gain_vs_baseline_rl"] = (result["avg_qos"] / base - 1) if base else None
    table = dict(sorted(table.items(), key=lambda item: float(item[0])))
    write_json(args.out, setup | {"table": table})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
