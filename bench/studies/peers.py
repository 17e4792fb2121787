"""`make bench STUDY=peers`: laneway against peer routers, in front of the same fakes, one run.

The peers, as published on PyPI and started with their documented defaults:
* vLLM Router (`vllm-router`, vllm-project/router: Rust, from SGLang's router), policy
  round_robin. It balances one model's workers, so one instance runs in front of each
  fake (the latency legs use the `fast` one, the streaming legs the `paced` one);
* the LiteLLM proxy (`litellm[proxy]`), one process, both models in its `model_list`
  as `hosted_vllm/` deployments.

Each target gets the overhead benchmark's measures (bench/studies/overhead.py: added latency
p50/p99 of non-streamed requests and of streamed TTFT, against the fake called
directly in alternating blocks; streamed tokens/s at 64 and 256 concurrent streams
paced at 20 ms/token as a ratio to direct; the target's CPU µs per relayed token
from /proc). The targets run one after another, `--rounds` times in alternating
order, so a drift of the machine does not favour one of them.

The peers are installed in their own venv (`.venv-peers`, `make bench STUDY=peers`), so
their pins never touch laneway's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.harness.ports import free_port
from bench.harness.results import write_json
from bench.harness.services import stop_process
from bench.studies.overhead import Legs, Plan, measure
from bench.studies.overhead_procs import fake_process, proxy_for, wait_ok
from predictors.home import REPO

PEERS_VENV = REPO / ".venv-peers"
PLAN = Plan(requests=1000, tokens=200, concurrency=(64, 256), repeat=1, idle_s=0)
QUICK = Plan(requests=100, tokens=50, concurrency=(64,), repeat=1, idle_s=0)
TARGETS = ("laneway", "vllm-router", "litellm")

# (fast URL, paced URL, pid whose CPU is counted while the paced streams run)
Target = tuple[str, str, int]


@contextlib.contextmanager
def peer_process(args: list[str], ready_url: str, cwd: str | None = None
                 ) -> Iterator[subprocess.Popen[bytes]]:
    """A peer's process until the block ends; its output goes to a temporary file."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(args, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                wait_ok(ready_url, proc)
            except RuntimeError:
                log.seek(0)
                sys.stderr.write(log.read()[-4000:].decode(errors="replace"))
                raise
            yield proc
        finally:
            stop_process(proc)


@contextlib.contextmanager
def vllm_router(*workers: str, policy: str = "round_robin") -> Iterator[tuple[str, int]]:
    """vLLM Router in front of `workers` (one model's servers) with `policy` (its
    round_robin, random, power_of_two, cache_aware, consistent_hash); (URL, pid)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with peer_process([str(PEERS_VENV / "bin" / "vllm-router"), "--worker-urls", *workers,
                       "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
                       "--prometheus-port", str(free_port())],  # two may run at once
                      f"{url}/health") as proc:
        yield url, proc.pid


@contextlib.contextmanager
def litellm(fast: str, paced: str) -> Iterator[tuple[str, int]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as scratch:
        deployments = "".join(
            f"  - model_name: {name}\n    litellm_params: {{model: hosted_vllm/{name}, "
            f'api_base: "{base}/v1", api_key: none}}\n'
            for name, base in (("fast", fast), ("paced", paced)))
        (Path(scratch) / "config.yaml").write_text(
            f"model_list:\n{deployments}litellm_settings: {{telemetry: false}}\n")
        with peer_process([str(PEERS_VENV / "bin" / "litellm"), "--config", "config.yaml",
                           "--host", "127.0.0.1", "--port", str(port)],
                          f"{url}/health/liveliness", cwd=scratch) as proc:
            yield url, proc.pid


@contextlib.contextmanager
def target(name: str, fast: str, paced: str) -> Iterator[Target]:
    if name == "laneway":
        with proxy_for(fast, paced) as proxy:
            yield proxy.url, proxy.url, proxy.pid
    elif name == "vllm-router":
        with vllm_router(fast) as (fast_url, _), vllm_router(paced) as (paced_url, pid):
            yield fast_url, paced_url, pid
    elif name == "litellm":
        with litellm(fast, paced) as (url, pid):
            yield url, url, pid
    else:
        raise ValueError(name)


def run(plan: Plan, names: tuple[str, ...], rounds: int) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with fake_process(0, "fast") as fast, fake_process(plan.tpot_ms, "paced") as paced:
        for round_ in range(rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                with target(name, fast, paced) as (target_fast, target_paced, pid):
                    legs = Legs(fast, paced, target_fast, target_paced, pid)
                    result = asyncio.run(measure(legs, plan))
                runs[name].append(result)
                print(f"round {round_ + 1}: {name}: {row(name, result)}", flush=True)
    return runs


def summary(result: dict[str, Any]) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = {}
    for key in ("non_stream", "ttft"):
        for q in ("p50", "p99"):
            out[f"{key}_added_{q}_ms"] = result[key][f"added_{q}_ms"]
    for streams, r in result["streaming"].items():
        out[f"ratio_{streams}"] = r["ratio"]
        out[f"cpu_us_per_token_{streams}"] = r["target_cpu_us_per_token"]
        out[f"failed_streams_{streams}"] = r["target_failed_streams"]
    return out


def row(name: str, result: dict[str, Any]) -> str:
    s = summary(result)
    cells = [f"{s[f'{key}_added_p50_ms']:+.2f} / {s[f'{key}_added_p99_ms']:+.2f} ms"
             for key in ("non_stream", "ttft")]
    for streams in result["streaming"]:
        cpu = s[f"cpu_us_per_token_{streams}"]
        cells.append(f"{s[f'ratio_{streams}']:.3f}x ({'n/a' if cpu is None else f'{cpu:.0f}'}"
                     f" µs/token, {s[f'failed_streams_{streams}']} failed)")
    return f"| {name} | " + " | ".join(cells) + " |"


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    first = next(iter(runs.values()))[0]
    head = ["target", "non-streamed added p50 / p99", "TTFT added p50 / p99",
            *(f"{s} streams: ratio to direct (CPU)" for s in first["streaming"])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [row(name, result) for name, results in runs.items() for result in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a small run (~2 min)")
    parser.add_argument("--json", type=Path, default=REPO / "docs" / "results" / "peers.json")
    args = parser.parse_args(argv)
    names = tuple(args.targets.split(","))
    if unknown := set(names) - set(TARGETS):
        parser.error(f"unknown targets {sorted(unknown)}; known: {', '.join(TARGETS)}")
    if set(names) - {"laneway"} and not PEERS_VENV.is_dir():
        parser.error(f"{PEERS_VENV} is missing: `make bench STUDY=peers` creates it")
    plan = QUICK if args.quick else PLAN
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    runs = run(plan, names, args.rounds)
    print(table(runs))
    write_json(args.json, {
        "plan": asdict(plan), "rounds": args.rounds,
        "peers": {"vllm-router": "0.1.17", "litellm": "1.100.5"},
        "summary": {name: [summary(r) for r in results] for name, results in runs.items()},
        "runs": runs,
        "command": "python -m bench.studies.peers " + " ".join(
            sys.argv[1:] if argv is None else argv)})
    print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
