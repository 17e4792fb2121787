"""Benchmark workloads: what to send and when. Seeded: equal specs give equal workloads.

Kinds:
* `trace`: Mooncake trace replay (`bench.harness.trace_replay`), real arrival times.
* `poisson`, `gamma`, `onoff`: alpaca_eval prompts at arrivals of that process
  (`bench.harness.arrivals`), each asking for the real length of one expert's answer.

A request asks for exactly `max_tokens` tokens (sent with `ignore_eos`), and prompt +
output fit the backends' context (`LengthFit`). A workload saves to JSONL: one
`{"type": "workload", ...}` line of metadata, then one line per request.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.harness.arrivals import Arrivals
from bench.models.lexicon import CHAT_TEMPLATE_TOKENS, Lexicon, alpaca_rows, load_lexicon, truncate
from predictors.length.data import is_heldout

ALPACA_KINDS = ("poisson", "gamma", "onoff")
KINDS = ("trace", *ALPACA_KINDS)


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    seq: int  # position in the workload, unique
    id: str  # same id → same prompt and max_tokens (solo latencies are keyed by it)
    arrival_s: float  # offset from the start of the run
    prompt: str  # the user message
    prompt_tokens: int  # of `prompt`, by the workload's lexicon (chat template excluded)
    max_tokens: int
    source: str = ""  # e.g. "alpaca_eval:helpful_base", "mooncake_conversation"
    quality: Mapping[str, float] = field(default_factory=dict)  # expert → score (QoS)
    slo_s: float | None = None  # end-to-end SLO sent as x-laneway-slo-ms, if any


@dataclass(frozen=True, slots=True)
class Workload:
    meta: Mapping[str, Any]
    requests: tuple[WorkloadRequest, ...]


@dataclass(frozen=True, slots=True)
class LengthFit:
    """How lengths are made to fit a backend's context.

    Lengths are divided by `scale` (prompt) and `output_scale` (output) and rounded
    (at least 1), the output is capped at `max_output`; then, if prompt + output +
    `margin` exceeds `context`, the output is cut first down to what leaves the prompt
    half the room, then the prompt. `scale=None`: automatic (traces only).
    """

    context: int = 1024
    scale: float | None = None
    output_scale: float | None = None
    max_output: int | None = None
    margin: int = CHAT_TEMPLATE_TOKENS + 5

    def clip(self, prompt: int, output: int) -> tuple[int, int]:
        room = self.context - self.margin
        if room < 2:
            raise ValueError(f"context {self.context} leaves no room")
        output = min(output, self.max_output or output, room - min(prompt, room // 2))
        return min(prompt, room - output), output


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    kind: str
    shared: Path
    n: int = 100
    duration_s: float | None = None
    seed: int = 0
    rate: float = 1.0
    cv: float = 2.0
    on_s: float = 10.0
    off_s: float = 10.0
    trace: str = "conversation"  # mooncake_<trace>.jsonl in <shared>/traces, or a path
    time_scale: float = 1.0
    start_s: float = 0.0
    expert: str = "gpt-3.5-turbo-1106"  # whose answer length an alpaca request asks for
    tokenizer: str = "auto"
    fit: LengthFit = LengthFit()
    # alpaca: "all" prompts, or "heldout" only (ids % 5 == 0: never trained on by the
    # project's predictors, so a predictor-driven policy sees prompts as in deployment)
    prompts: str = "all"


def build(spec: WorkloadSpec) -> Workload:
    rows = alpaca_rows(spec.shared)
    lexicon = load_lexicon(spec.tokenizer, [r["instruction"] for r in rows])
    if spec.kind == "trace":
        from bench.harness.trace_replay import replay

        return replay(spec, lexicon)
    if spec.kind in ALPACA_KINDS:
        return alpaca(spec, rows, lexicon)
    raise ValueError(f"unknown workload kind {spec.kind!r}; known: {', '.join(KINDS)}")


def alpaca(spec: WorkloadSpec, rows: list[dict[str, Any]], lexicon: Lexicon) -> Workload:
    if spec.prompts == "heldout":
        rows = [r for r in rows if is_heldout(int(r["id"]))]
    elif spec.prompts != "all":
        raise ValueError(f"unknown prompt set {spec.prompts!r}; known: all, heldout")
    arrivals = Arrivals(spec.kind, spec.rate, spec.cv, spec.on_s, spec.off_s)
    offsets = arrivals.offsets(spec.n, spec.duration_s, spec.seed)
    order = random.Random(spec.seed).sample(range(len(rows)), len(rows))
    picked = [rows[order[i % len(rows)]] for i in range(len(offsets))]
    prompts = lexicon.count_batch([r["instruction"] for r in picked])
    outputs = lexicon.count_batch([_answer(r, spec.expert) for r in picked])
    scale = spec.fit.output_scale or 1.0
    requests = []
    for seq, (row, at, prompt_tokens, output_tokens) in enumerate(
            zip(picked, offsets, prompts, outputs, strict=True)):
        fitted, max_tokens = spec.fit.clip(prompt_tokens, max(1, round(output_tokens / scale)))
        prompt = row["instruction"]
        if fitted < prompt_tokens:
            prompt = truncate(lexicon, prompt, fitted)
            fitted = lexicon.count(prompt)
        requests.append(WorkloadRequest(
            seq, f"alpaca-{row['id']}", at, prompt, fitted, max_tokens,
            f"alpaca_eval:{row['dataset']}",
            {name: e["win_rate_vs_reference"] for name, e in row["experts"].items()}))
    meta = {"kind": spec.kind, "seed": spec.seed, "arrivals": asdict(arrivals),
            "mean_rate": arrivals.mean_rate, "expert": spec.expert, "lexicon": lexicon.name,
            "exact_lengths": lexicon.exact, "fit": asdict(spec.fit), "prompts": spec.prompts}
    return Workload(meta, tuple(requests))


def _answer(row: dict[str, Any], expert: str) -> str:
    experts: dict[str, Any] = row["experts"]
    if expert not in experts:
        raise ValueError(f"unknown expert {expert!r}; known: {', '.join(experts)}")
    answer: str = experts[expert]["output"]
    return answer


def save(workload: Workload, path: Path) -> None:
    with path.open("wb") as f:
        f.write(orjson.dumps({"type": "workload", **workload.meta}) + b"\n")
        for request in workload.requests:
            f.write(orjson.dumps(request) + b"\n")


def load(path: Path) -> Workload:
    with path.open("rb") as f:
        lines = [orjson.loads(line) for line in f if line.strip()]
    if not lines or lines[0].get("type") != "workload":
        raise ValueError(f"{path}: not a saved workload (first line must be its metadata)")
    meta = {k: v for k, v in lines[0].items() if k != "type"}
    return Workload(meta, tuple(WorkloadRequest(**row) for row in lines[1:]))
