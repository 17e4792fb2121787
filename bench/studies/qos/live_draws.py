"""qos_drl against Baseline RL at one λ over several arrival draws, live and simulated
(issue 8, point 7): how much of the live gain is the draw.

`make bench STUDY=qos-live` replays one draw of the held-out arrivals (`bench.studies.qos.live`,
seed 7); one draw of 600 arrivals moves the two agents' QoS ratio by several per cent.
This runs the two agents live (`bench.studies.qos.live --policies qos_drl,baseline_rl --seed s`,
an emulated fleet per run, ~5 min a seed) and in the simulator on the same arrivals
(`bench.studies.qos.headroom --only qos_drl baseline_rl --seed s`, seconds), for each seed, and
reports the gain per draw and the mean (both with `--checkpoint` and
`--baseline-checkpoint`, default those of `python -m bench train qos-drl`, and the distilled
bucket predictor). A draw whose live result is
already in `--dir` (or, for the draw of `--full-run`, in that run's JSON) is not run
live again. Writes `--dir`/draws.{json,md} and merges `live_draws` (and
`qos_gain_vs_baseline_rl_live_draws_mean`) into docs/results/qos_drl.json; the issue's
`qos_gain_vs_baseline_rl` stays the full run's (`bench.studies.qos.live`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.harness.report import git_commit
from bench.harness.results import write_json
from bench.studies.qos import headroom as qos_headroom
from bench.studies.qos import live as qos_live
from bench.studies.qos.live_report import AGENT_KEYS, agents_of, repo_path, same_agents
from bench.studies.qos.train import add_agent_arguments, default_checkpoint
from predictors.home import ALPACA_EVAL, REPO

RESULTS = REPO / "docs" / "results"
AGENTS = ("qos_drl", "baseline_rl")


def default_checkpoints() -> dict[str, str]:
    return {"checkpoint": repo_path(default_checkpoint(False)),
            "baseline_checkpoint": repo_path(default_checkpoint(True))}


def live_qos(path: Path, seed: int, rate: str, arrivals: int,
             agents: Mapping[str, str] | None = None) -> dict[str, float] | None:
    """The two agents' live average QoS at λ `rate` from a `bench.studies.qos.live` JSON of
    this draw (seed and number of arrivals) and these agents (`agents_of`'s, default
    `python -m bench train qos-drl`'s paths), or None when the file is missing or is of another
    draw or other agents (`same_agents`). A file that names no agents predates the field
    and was made with the default ones: it matches only agents asked for by path alone."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    row = data.get("table", {}).get(rate, {})
    recorded = default_checkpoints() | {k: data[k] for k in AGENT_KEYS if k in data}
    if ((data.get("seed"), data.get("arrivals_per_run")) != (seed, arrivals)
            or not same_agents(recorded, agents or default_checkpoints())
            or any(agent not in row for agent in AGENTS)):
        return None
    return {agent: row[agent]["avg_qos"] for agent in AGENTS}


def agent_arguments(args: argparse.Namespace) -> list[str]:
    return ["--checkpoint", str(args.checkpoint),
            "--baseline-checkpoint", str(args.baseline_checkpoint)]


def simulated_qos(args: argparse.Namespace, seed: int, out: Path) -> dict[str, float]:
    qos_headroom.main(["--data", str(args.data), "--rates", f"{args.rate:g}",
                       "--arrivals", str(args.arrivals), "--seed", str(seed),
                       "--only", *AGENTS, "--out", str(out), *agent_arguments(args)])
    row = json.loads(out.read_text())["table"][f"{args.rate:g}"]
    return {agent: row[agent]["avg_qos"] for agent in AGENTS}


def gain(qos: dict[str, float]) -> float:
    return qos["qos_drl"] / qos["baseline_rl"] - 1


def draw(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rate = f"{args.rate:g}"
    here = args.dir / f"seed{seed}"
    agents = agents_of(args.checkpoint, args.baseline_checkpoint)
    live = (live_qos(args.full_run, seed, rate, args.arrivals, agents)
            or live_qos(here / "qos_live.json", seed, rate, args.arrivals, agents))
    if live is None:
        qos_live.main(["--data", str(args.data), "--rates", rate, "--arrivals",
                       str(args.arrivals), "--policies", ",".join(AGENTS), "--seed",
                       str(seed), "--no-merge", "--out", str(here / "qos_live.json"),
                       *agent_arguments(args)])
        live = live_qos(here / "qos_live.json", seed, rate, args.arrivals, agents)
        assert live is not None, f"bench.studies.qos.live wrote no λ={rate} result for seed {seed}"
    simulated = simulated_qos(args, seed, here / "simulated.json")
    return {"seed": seed, "live": live, "simulated": simulated,
            "gain_live": round(gain(live), 4), "gain_simulated": round(gain(simulated), 4)}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"qos_drl vs Baseline RL at λ = {result['lambda']:g}, {result['arrivals']} "
             "held-out arrivals per draw, live (emulated fleet, through the proxy) and in "
             "the simulator on the same arrivals.\n",
             "| seed | live qos_drl / Baseline RL | live gain | simulated qos_drl / "
             "Baseline RL | simulated gain |", "|---:|---|---:|---|---:|"]
    for row in result["draws"]:
        live, sim = row["live"], row["simulated"]
        lines.append(f"| {row['seed']} | {live['qos_drl']:.3f} / {live['baseline_rl']:.3f} | "
                     f"{row['gain_live']:+.1%} | {sim['qos_drl']:.3f} / "
                     f"{sim['baseline_rl']:.3f} | {row['gain_simulated']:+.1%} |")
    summary = result["summary"]
    lines.append(f"| mean | | **{summary['gain_live_mean']:+.1%}** (range "
                 f"{summary['gain_live_min']:+.1%} to {summary['gain_live_max']:+.1%}) | | "
                 f"{summary['gain_simulated_mean']:+.1%} |")
    return "\n".join(lines) + "\n"


def summarize(draws: list[dict[str, Any]]) -> dict[str, float]:
    live = [row["gain_live"] for row in draws]
    simulated = [row["gain_simulated"] for row in draws]
    return {"gain_live_mean": round(statistics.fmean(live), 4),
            "gain_live_min": min(live), "gain_live_max": max(live),
            "gain_simulated_mean": round(statistics.fmean(simulated), 4),
            "draws_live_ahead": sum(g > 0 for g in live)}


def merge(path: Path, result: dict[str, Any]) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data["qos_gain_vs_baseline_rl_live_draws_mean"] = result["summary"]["gain_live_mean"]
    data["live_draws"] = {key: result[key] for key in
                          ("lambda", "arrivals", "summary", "draws", *AGENT_KEYS,
                           "command", "commit")}
    path.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=ALPACA_EVAL)
    parser.add_argument("--seeds", type=int, nargs="+", default=[7, 8, 9, 10, 11, 12])
    parser.add_argument("--rate", type=float, default=5.0)
    parser.add_argument("--arrivals", type=int, default=600)
    parser.add_argument("--dir", type=Path, default=RESULTS / "qos_live_draws")
    parser.add_argument("--full-run", type=Path, default=RESULTS / "qos_live.json",
                        help="a full `make bench STUDY=qos-live` result whose draw is reused")
    add_agent_arguments(parser)
    parser.add_argument("--merge-into", type=Path, default=RESULTS / "qos_drl.json")
    parser.add_argument("--no-merge", action="store_true")
    args = parser.parse_args(argv)
    draws = [draw(args, seed) for seed in args.seeds]
    result = {"lambda": args.rate, "arrivals": args.arrivals, "draws": draws,
              "summary": summarize(draws), **agents_of(args.checkpoint, args.baseline_checkpoint),
              "command": " ".join(["python -m bench.studies.qos.live_draws",
                                   *(sys.argv[1:] if argv is None else argv)]),
              "commit": git_commit()}
    write_json(args.dir / "draws.json", result)
    (args.dir / "draws.md").write_text(markdown(result))
    if not args.no_merge:
        merge(args.merge_into, result)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
