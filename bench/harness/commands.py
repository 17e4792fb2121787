"""What `python -m bench workload|run|solo|report` do (parsers: `bench.harness.cli`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import orjson
import yaml

from bench.harness import loadgen, results, workloads
from bench.harness.plots import write_plots
from bench.harness.proxy_process import running_proxy
from bench.harness.report import QosConfig, summarize
from bench.harness.solo import SoloLatencies
from bench.harness.sse_client import Target
from bench.harness.tables import latency_table, slo_table
from bench.harness.workloads import LengthFit, Workload, WorkloadRequest, WorkloadSpec
from bench.models.lexicon import CHAT_TEMPLATE_TOKENS
from predictors.home import laneway_home


def load_workload(args: argparse.Namespace) -> Workload:
    if args.workload not in workloads.KINDS:
        return workloads.load(Path(args.workload))
    fit = LengthFit(args.context, args.length_scale, args.output_scale, args.max_output)
    return workloads.build(WorkloadSpec(
        args.workload, Path(args.shared), args.requests, args.duration, args.seed, args.rate,
        args.cv, args.on_s, args.off_s, args.trace, args.time_scale, args.start_s,
        args.expert, args.tokenizer, fit, args.prompts))


def describe(workload: Workload) -> str:
    requests = workload.requests
    arrivals = [r.arrival_s for r in requests]
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    prompts = np.array([r.prompt_tokens for r in requests] or [0])
    outputs = np.array([r.max_tokens for r in requests] or [0])
    return "\n".join([
        f"{len(requests)} requests over {span:.1f}s "
        f"({(len(requests) - 1) / span if span else 0:.2f} req/s), "
        f"{len({r.id for r in requests})} distinct prompts, lexicon {workload.meta['lexicon']}",
        f"prompt tokens p50/p90/max {np.percentile(prompts, 50):.0f}/"
        f"{np.percentile(prompts, 90):.0f}/{prompts.max()}; "
        f"max_tokens p50/p90/max {np.percentile(outputs, 50):.0f}/"
        f"{np.percentile(outputs, 90):.0f}/{outputs.max()}"])


def workload(args: argparse.Namespace) -> int:
    built = load_workload(args)
    if args.out:
        workloads.save(built, Path(args.out))
        print(f"saved {args.out}")
    print(describe(built))
    return 0


def with_slos(requests: Sequence[WorkloadRequest], solo: SoloLatencies, scale: float
              ) -> list[WorkloadRequest]:
    """Each request's SLO = scale x its solo latency, when that is known."""
    def slo(r: WorkloadRequest) -> float | None:
        base = solo.estimate(r.id, r.prompt_tokens + CHAT_TEMPLATE_TOKENS, r.max_tokens)
        return None if base is None else scale * base

    return [dataclasses.replace(r, slo_s=slo(r)) for r in requests]


def target(url: str, args: argparse.Namespace) -> Target:
    headers = tuple((name.strip(), value.strip())
                    for name, _, value in (h.partition(":") for h in args.header))
    return Target(url.rstrip("/"), args.model, args.request_timeout, headers,
                  args.hide_length)


def read_solo(paths: Sequence[str], base: str = "request") -> SoloLatencies | None:
    """The solo latencies in `paths` under SLO base `base` (bench/harness/solo.py)."""
    if not paths:
        return None
    solo = SoloLatencies.from_results(r for p in paths for r in results.read(Path(p)).results)
    return solo.based_on(base)


@contextlib.contextmanager
def _target(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """(URL, policy): the given proxy, or one started from --config for the run."""
    if args.target:
        yield args.target.rstrip("/"), args.policy or "-"
        return
    config = yaml.safe_load(Path(args.config).read_text())
    if args.policy:
        config["policy"] = {"name": args.policy, "params": {}}
    log = Path(args.proxy_log) if args.proxy_log else None
    with running_proxy(config, log_path=log) as proxy:
        yield proxy.url, config.get("policy", {}).get("name", "round_robin")


def _send(requests: Sequence[WorkloadRequest], targets: Sequence[Target],
          limits: loadgen.Limits | None, out: Path, header: dict[str, object], quiet: bool
          ) -> loadgen.RunSummary:
    """A load run on `targets[0]` within `limits`, or with `limits` None solo latencies
    over every target (`loadgen.run_solo`)."""
    with results.writing(out) as writer:
        writer.header({**header, "started_unix": time.time(), "limits": limits})
        progress = None if quiet else sys.stderr
        sending = (loadgen.run_solo(requests, targets, writer, progress) if limits is None
                   else loadgen.run(requests, targets[0], limits, writer, progress))
        summary = asyncio.run(sending)
    print(f"{summary.sent} sent ({summary.skipped} skipped), {summary.errors} errors, "
          f"{summary.wall_s:.1f}s; results: {out}")
    return summary


def run(args: argparse.Namespace) -> int:
    built = load_workload(args)
    requests: Sequence[WorkloadRequest] = built.requests
    solo = read_solo(args.solo, args.slo_base)
    if solo is not None:
        requests = with_slos(requests, solo, args.slo_scale)
    limits = loadgen.Limits(args.max_requests, args.duration, args.time_limit, args.concurrency)
    with _target(args) as (url, policy):
        label = args.label or (policy if policy != "-" else "run")
        out = Path(args.out) if args.out else laneway_home() / "bench" / f"{label}.jsonl"
        header = {"mode": "load", "label": label, "policy": policy, "target": url,
                  "model": args.model, "workload": built.meta}
        summary = _send(requests, [target(url, args)], limits, out, header,
                        args.no_progress)
    return 0 if summary.sent else 1


def solo(args: argparse.Namespace) -> int:
    built = load_workload(args)
    chosen = loadgen.Limits(args.max_requests, args.duration).select(built.requests)
    out = Path(args.out) if args.out else laneway_home() / "bench" / "solo.jsonl"
    header = {"mode": "solo", "label": "solo", "policy": "-", "target": args.target,
              "model": args.model, "repeats": args.repeats, "workload": built.meta}
    summary = _send(chosen * args.repeats, [target(url, args) for url in args.target], None,
                    out, header, args.no_progress)
    return 0 if summary.sent and not summary.errors else 1


def report(args: argparse.Namespace) -> int:
    runs = [results.read(Path(p)) for p in args.results]
    solo_latencies = read_solo(args.solo, args.slo_base)
    scales = [float(s) for s in args.scales.split(",")]
    expert_map = dict(item.split("=", 1) for item in args.expert_map)
    qos_config = QosConfig(args.qos_latency_ms / 1000, expert_map)
    summaries = [summarize(r, solo_latencies, scales, qos_config) for r in runs]
    tables = [latency_table(summaries), slo_table(summaries)]
    text = "\n\n".join(t for t in tables if t)
    print(text)
    out_dir = Path(args.out_dir) if args.out_dir else laneway_home() / "bench" / "report"
    pngs = write_plots(runs, summaries, out_dir, args.load_scale)
    (out_dir / "report.md").write_text(text + "\n")
    (out_dir / "summary.json").write_bytes(orjson.dumps(summaries, option=orjson.OPT_INDENT_2))
    print(f"\nwrote {out_dir / 'report.md'}, summary.json, " + ", ".join(p.name for p in pngs))
    return 0
