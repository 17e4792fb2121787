"""A live qos_drl run's own decisions replayed in the simulator (issue 8, diagnosis).

`bench.studies.qos.live --records DIR` writes every run's requests: arrival order, prompt,
the expert that served it (or the drop) and the latency per token the client saw.
Replaying exactly those actions in `QosSim`, with the same arrivals (same seed) and
the live run's answer cap, takes the policy out of the comparison: what remains is the
simulator's latency model against the real fleet on the very same requests. If the
same requests on the same experts run faster in the simulator, the agents were
trained on a fleet faster than the one they serve.

Per run and per `--cores` share and `--solo` slowdown (QosSim's; the GPU fleet has
neither): live and
simulated average QoS, and per expert the live and simulated latency per token (p50,
p90) with the median of the per-request ratio live / simulated.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.results import write_json
from bench.studies.qos.live import REAL_ANSWER_CAP
from bench.studies.qos.setup import fleet, load_pools, trained_fleet
from bench.studies.qos.sim import ExpertSpec, PoolPrompt, QosSim, SimRequest
from bench.studies.qos.train import default_checkpoint
from policies.qos_drl.sac import load_checkpoint
from predictors.home import ALPACA_EVAL, REPO

RESULTS = REPO / "docs" / "results"


def read_records(path: Path) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(records, key=lambda r: r["seq"])


def action(record: Mapping[str, Any]) -> int:
    """The simulator's action for a live record: 0 = drop (a request that failed before
    a backend counts as one), n = expert n-1."""
    return 0 if record["dropped"] or record["expert"] < 0 else record["expert"] + 1


def replay(specs: Sequence[ExpertSpec], pool: Sequence[PoolPrompt], rate: float,
           limit_s: float, seed: int, cores: float | None, solo: float,
           records: Sequence[Mapping[str, Any]]) -> list[SimRequest]:
    """The records' actions on a fresh simulator; its requests in arrival order."""
    sim = QosSim(specs, pool, rate, limit_s, seed=seed, cores=cores, solo=solo)
    requests = []
    for record in records:
        request = sim.arrive()
        if request.prompt.id != record["prompt_id"]:
            raise SystemExit(f"arrival {record['seq']}: the simulator drew prompt "
                             f"{request.prompt.id}, the live run {record['prompt_id']} "
                             "(another seed, split or data file?)")
        sim.route(action(record))
        requests.append(request)
    sim.drain()
    return requests


def percentiles_ms(values: Sequence[float]) -> dict[str, float]:
    ms = np.array(values) * 1000
    return {"p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90))}


def compare(records: Sequence[Mapping[str, Any]], simulated: Sequence[SimRequest],
            experts: Sequence[str]) -> dict[str, Any]:
    """Live against simulated: average QoS over every arrival, and per expert the
    latency per token of the requests both completed."""
    per_expert: dict[str, Any] = {}
    for n, name in enumerate(experts):
        pairs = [(r["lpt_s"], s.latency_per_token) for r, s in zip(records, simulated,
                                                                   strict=True)
                 if r["expert"] == n and not r["dropped"] and r["lpt_s"] is not None
                 and s.latency_per_token is not None]
        if not pairs:
            continue
        live, sim = zip(*pairs, strict=True)
        per_expert[name] = {
            "requests": len(pairs), "live_lpt_ms": percentiles_ms(live),
            "sim_lpt_ms": percentiles_ms(sim),
            "median_ratio_live_to_sim": float(np.median(np.array(live) / np.array(sim)))}
    return {"live_avg_qos": float(np.mean([r["qos"] for r in records])),
            "sim_avg_qos": float(np.mean([s.qos or 0.0 for s in simulated])),
            "experts": per_expert}


def run_name(path: Path) -> tuple[str, float]:
    """`qos_drl-1.5.jsonl` → ("qos_drl", 1.5), as bench.studies.qos.live names its records."""
    policy, _, rate = path.stem.rpartition("-")
    return policy, float(rate)


def capped_pool(pool: Sequence[PoolPrompt], cap: int | None) -> list[PoolPrompt]:
    if cap is None:
        return list(pool)
    return [replace(p, lengths=tuple(min(d, cap) for d in p.lengths)) for p in pool]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=Path, required=True,
                        help="a `bench.studies.qos.live --records` directory")
    parser.add_argument("--data", type=Path, default=ALPACA_EVAL)
    parser.add_argument("--checkpoint", type=Path, default=default_checkpoint(False),
                        help="the live run's qos_drl checkpoint: its fleet and L")
    parser.add_argument("--cores", type=float, nargs="*", default=None,
                        help="shared cores to simulate on (default: the checkpoint's)")
    parser.add_argument("--solo", type=float, nargs="*", default=None,
                        help="QosSim's solo slowdowns to simulate with (default: the "
                        "checkpoint's)")
    parser.add_argument("--seed", type=int, default=7, help="the live run's")
    parser.add_argument("--max-answer-tokens", type=int, default=None,
                        help="the live run's answer cap (default: real fleet's 1792, "
                        "none for the GPU fleet)")
    parser.add_argument("--out", type=Path, default=RESULTS / "qos_replay_live.json")
    args = parser.parse_args(argv)
    meta = load_checkpoint(args.checkpoint)[1]
    mapping, trained_cores, trained_solo = trained_fleet(meta)
    limit_s = float(meta.get("limit_ms", 30.0)) / 1000
    cap = args.max_answer_tokens or (REAL_ANSWER_CAP if trained_cores is not None else None)
    experts, _, heldout, _ = load_pools(args.data, None)  # the split; predictions unused
    specs, pool = fleet(experts, mapping), capped_pool(heldout, cap)
    shares = [(cores, solo) for cores in args.cores or [trained_cores]
              for solo in args.solo or [trained_solo]]
    runs: dict[str, Any] = {}
    for path in sorted(args.records.glob("*.jsonl")):
        policy, rate = run_name(path)
        records = read_records(path)
        runs[path.stem] = {"policy": policy, "rate": rate, "arrivals": len(records),
                           "simulated": {}}
        for cores, solo in shares:
            simulated = replay(specs, pool, rate, limit_s, args.seed, cores, solo, records)
            cell = compare(records, simulated, experts)
            runs[path.stem]["simulated"][f"cores {cores}, solo {solo}"] = cell
            print(f"{path.stem} cores {cores} solo {solo}: QoS live {cell['live_avg_qos']:.3f} sim "
                  f"{cell['sim_avg_qos']:.3f}; " + ", ".join(
                      f"{name[:14]} lpt p50 {e['live_lpt_ms']['p50']:.1f}/"
                      f"{e['sim_lpt_ms']['p50']:.1f} ms (x{e['median_ratio_live_to_sim']:.2f})"
                      for name, e in cell["experts"].items()), flush=True)
    result = {"records": str(args.records), "checkpoint": str(args.checkpoint),
              "fleet": mapping, "limit_ms": limit_s * 1000, "answer_cap": cap,
              "runs": runs, "command": " ".join(["python -m bench.studies.qos.replay_live",
                                                 *sys.argv[1:]])}
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
