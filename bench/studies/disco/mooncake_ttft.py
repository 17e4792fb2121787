"""The server TTFT distribution F for DiSCo's simulator, from the Mooncake trace.

No public per-request TTFT trace of a commercial API is available here (issue 66), so F
is derived: the Mooncake conversation trace (real prompt and output lengths, prefixes
shared as its hash ids share them) replayed, in emulated time, against a fleet of
emulated H100s (bench/emulator: vLLM's V1 scheduler on a step-time model, prefix cache
included) with join-the-shortest-queue dispatch. The rule, fixed before any DiSCo
figure was looked at:

* `GPUS` h100-80gb engines (Llama-3.1-8B), the context raised to the model's 128k (the
  trace's prompts reach 20k+ tokens);
* the first `REQUESTS` requests of the trace, their arrival times compressed by a
  factor k from `LADDER`;
* "near saturation" = the first k whose median TTFT is at least `KNEE` times the median
  at k = 1 (queues have formed, the fleet still keeps up); its TTFTs are F.

The first run's ladder (1, 1.5, 2, 3, ...) went from a median of 0.66 s at k = 2 to 6.5 s
at k = 3, past the knee into an overloaded fleet; the ladder was made finer between 2
and 3 before the simulator was run on either result.

    python -m bench.studies.disco.mooncake_ttft [--shared datasets] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.emulator.engine import Engine, Sequence
from bench.emulator.profile import load_profile
from bench.fakes.fake_metrics import TTFT_BUCKETS, FakeStats, Histogram
from predictors.home import DATASETS, open_text

GPUS = 8
PROFILE = "h100-80gb"
CONTEXT = 131_072  # Llama-3.1-8B's context
REQUESTS = 1000
LADDER = (1.0, 1.5, 2.0, 2.25, 2.5, 2.75, 3.0, 4.0, 6.0, 8.0, 12.0)
KNEE = 2.0
BLOCK_TOKENS = 512  # tokens per trace hash id
VOCAB = 30_000
OUT = Path("docs/results/disco_mooncake_ttft.json")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    hash_ids: tuple[int, ...]
    input_tokens: int
    output_tokens: int


def load_trace(shared: Path, n: int) -> list[TraceRequest]:
    rows: list[TraceRequest] = []
    with open_text(shared / "traces" / "mooncake_conversation.jsonl") as lines:
        for line in lines:
            if len(rows) == n:
                break
            row = json.loads(line)
            rows.append(TraceRequest(row["timestamp"] / 1000, tuple(row["hash_ids"]),
                                     row["input_length"], max(1, row["output_length"])))
    return rows


class _Ttfts(Histogram):
    """The engine's TTFT histogram, also keeping every value."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        super().__init__(TTFT_BUCKETS)
        self.values: list[float] = []

    def observe(self, value: float) -> None:
        super().observe(value)
        self.values.append(value)


def _prompt(request: TraceRequest, blocks: dict[int, list[int]]) -> list[int]:
    """Token ids: one fixed block of `BLOCK_TOKENS` ids per hash id, cut to the length,
    so equal hash ids are equal (cacheable) prefixes."""
    ids: list[int] = []
    for hash_id in request.hash_ids:
        if len(ids) >= request.input_tokens:
            break
        if hash_id not in blocks:
            rng = random.Random(hash_id)
            blocks[hash_id] = [rng.randrange(1, VOCAB) for _ in range(BLOCK_TOKENS)]
        ids += blocks[hash_id]
    return ids[:request.input_tokens]


def replay(trace: list[TraceRequest], compress: float, gpus: int = GPUS) -> list[float]:
    """The TTFT of every request of `trace` with arrivals `compress` times closer."""
    profile = load_profile(PROFILE).model_copy(update={"max_model_len": CONTEXT})
    ttfts = _Ttfts()
    engines = []
    for _ in range(gpus):
        stats = FakeStats(keep_bodies=False)
        stats.ttft = ttfts
        engines.append(Engine(profile, stats, manual=True))
    blocks: dict[int, list[int]] = {}
    start = trace[0].arrival_s
    for request in trace:
        now = (request.arrival_s - start) / compress
        for engine in engines:
            _run_until(engine, now)
        engine = min(engines, key=lambda e: len(e.running) + len(e.waiting))
        engine.now = max(engine.now, now)
        engine.add(Sequence(_prompt(request, blocks), 0, request.output_tokens, now), at=now)
    for engine in engines:
        while engine.advance():
            pass
    assert len(ttfts.values) == len(trace), (len(ttfts.values), len(trace))
    return ttfts.values


def _run_until(engine: Engine, until: float) -> None:
    while engine._step_end is not None and engine._step_end <= until:
        engine.advance()


def knee(medians: dict[float, float], factor: float = KNEE) -> float | None:
    """The first compression whose median TTFT is `factor` times the first one's."""
    ladder = sorted(medians)
    base = medians[ladder[0]]
    return next((k for k in ladder if medians[k] >= factor * base), None)


def _ladder(trace: list[TraceRequest]) -> Iterator[tuple[float, list[float]]]:
    for compress in LADDER:
        started = time.monotonic()
        values = replay(trace, compress)
        print(f"k={compress:g}: median TTFT {statistics.median(values):.3f} s, p99 "
              f"{sorted(values)[int(0.99 * len(values))]:.3f} s "
              f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
        yield compress, values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shared", type=Path, default=DATASETS)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--requests", type=int, default=REQUESTS)
    args = parser.parse_args(argv)
    trace = load_trace(args.shared, args.requests)
    runs: dict[float, list[float]] = {}
    for compress, values in _ladder(trace):
        runs[compress] = values
        chosen = knee({k: statistics.median(v) for k, v in runs.items()})
        if chosen is not None:
            break
    if chosen is None:
        raise SystemExit(f"no compression up to {LADDER[-1]:g} reached {KNEE:g}x the "
                         "unloaded median TTFT: raise the ladder")
    values = sorted(runs[chosen])
    offered = len(trace) / ((trace[-1].arrival_s - trace[0].arrival_s) / chosen)
    report: dict[str, Any] = {
        "source": "Mooncake conversation trace, emulated fleet (bench/studies/disco/"
                  "mooncake_ttft.py)",
        "gpus": GPUS, "profile": PROFILE, "context": CONTEXT, "requests": len(trace),
        "ladder": {f"{k:g}": round(statistics.median(v), 4) for k, v in runs.items()},
        "knee_factor": KNEE, "compression": chosen,
        "offered_req_per_s": round(offered, 3),
        "median_s": round(statistics.median(values), 4),
        "p99_s": round(values[int(0.99 * len(values))], 4),
        "ttft_s": [round(v, 5) for v in values],
        "command": " ".join(["python -m bench.studies.disco.mooncake_ttft", *(argv or [])]),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report) + "\n")
    print(f"F: {len(values)} TTFTs at k={chosen:g} ({offered:.2f} req/s on {GPUS} GPUs), "
          f"median {report['median_s']} s, p99 {report['p99_s']} s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
