"""What an emulated vLLM instance is like: its step-time model and its limits.

One engine step (one forward pass over a batch) takes

    t_step = a + b·tokens + c·seqs + d·context + e·pairs

where `tokens` are the tokens computed in the step (prefill chunks + one per decoding
request), `seqs` the requests in the batch, `context` the KV entries the step reads
(for each scheduled chunk of n tokens after p computed ones: p + n) and `pairs` the
causal attention pairs it computes (n·p + n(n+1)/2; a decode token: its context).
`a` is the fixed cost (weights read once per step on a GPU, Python and launch
overhead on CPU), `b` the per-token compute, `c` per-request work (sampling, output
processing), `d` the KV read (what makes GPU decode slower with long contexts; on CPU
the first `free_context_per_seq` entries of each request stay in the caches and cost
nothing measurable, so `context` counts only what a request reads beyond them), `e`
the attention compute (what makes long prefills superlinear). `request_overhead_s` is
the API server's own work per request (parse, tokenize, hand to the engine) before the
request reaches the scheduler and `chunk_overhead_s` its work per streamed chunk: vLLM's
single API-server process shares its CPU between them all (`frontend.py`), at
`frontend_speed_while_stepping` while the engine steps; `request_latency_s` is the rest
of a request's fixed cost, which overlaps between requests (hops between processes).
`fit.py` measures and splits them.

Profiles are YAML files in `profiles/`; `load_profile("a100-40gb")` or a path.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


class StepModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    base_s: float = Field(ge=0, description="a: fixed cost of a step")
    per_token_s: float = Field(ge=0, description="b: per token computed in the step")
    per_seq_s: float = Field(0.0, ge=0, description="c: per request in the batch")
    per_context_s: float = Field(0.0, ge=0, description="d: per KV entry read")
    per_pair_s: float = Field(0.0, ge=0, description="e: per attention pair computed")
    free_context_per_seq: int = Field(
        0, ge=0, description="KV entries per request a step reads at no measurable cost "
        "(on CPU they stay in the caches)")

    def read_context(self, kv_len: int) -> int:
        """What a request whose step reads `kv_len` KV entries adds to `context`."""
        return max(0, kv_len - self.free_context_per_seq)

    def seconds(self, tokens: int, seqs: int, context: int, pairs: int) -> float:
        """`context`: the sum of `read_context` over the batch's requests."""
        return (self.base_s + self.per_token_s * tokens + self.per_seq_s * seqs
                + self.per_context_s * context + self.per_pair_s * pairs)


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    model: str = Field(description="served model name by default")
    step: StepModel
    request_overhead_s: float = Field(0.0, ge=0, description="API-server work per request "
                                      "before the scheduler, sharing its CPU")
    request_latency_s: float = Field(0.0, ge=0, description="fixed delay per request "
                                     "before the scheduler, overlapping between requests")
    chunk_overhead_s: float = Field(0.0, ge=0, description="API-server work per streamed "
                                    "chunk, sharing its CPU with requests")
    frontend_speed_while_stepping: float = Field(
        1.0, gt=0, le=1, description="the API server's share of a CPU while the engine "
        "steps (1: a core of its own)")
    max_num_seqs: int = Field(gt=0)
    max_num_batched_tokens: int = Field(gt=0)
    kv_blocks: int = Field(gt=0, description="KV cache capacity in blocks")
    block_size: int = Field(16, gt=0)
    max_model_len: int = Field(gt=0)
    sources: list[str] = Field(default_factory=list, description="where the figures come from")
    derivation: str = ""
    fit: dict[str, Any] | None = Field(None, description="fitted profiles: data and residuals")

    @model_validator(mode="after")
    def _kv_holds_one_request(self) -> Profile:
        if self.kv_blocks * self.block_size < self.max_model_len:
            raise ValueError("kv_blocks * block_size must hold max_model_len tokens")
        return self

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size


def dilated_fields(model: BaseModel, names: Iterable[str], factor: float) -> dict[str, float]:
    """`model`'s durations `names`, `factor` times longer (a `model_copy` update, or
    config values)."""
    return {name: getattr(model, name) * factor for name in names}


def dilated(profile: Profile, factor: float) -> Profile:
    """`profile` with every duration `factor` times longer: step-time coefficients and
    the API server's per-request and per-chunk costs (limits unchanged). A fleet too
    large for this machine at real speed runs dilated, with arrivals `factor` times
    sparser: what the fleet does is the same, only slower, and the proxy, the load
    generator and the emulator get `factor` times the CPU per event (`bench_goodput
    --time-dilation`)."""
    if factor <= 0:
        raise ValueError(f"time dilation must be positive, got {factor}")
    if factor == 1:
        return profile
    step = profile.step.model_copy(update=dilated_fields(
        profile.step, ("base_s", "per_token_s", "per_seq_s", "per_context_s", "per_pair_s"),
        factor))
    overheads = dilated_fields(
        profile, ("request_overhead_s", "request_latency_s", "chunk_overhead_s"), factor)
    return profile.model_copy(update={
        "step": step, **overheads,
        "description": f"{profile.description} (time dilated {factor:g}x)".strip()})


def profile_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        return path
    return PROFILES_DIR / f"{name_or_path}.yaml"


def load_profile(name_or_path: str) -> Profile:
    """A profile by name (a file in `profiles/`) or by path (YAML or JSON)."""
    return Profile.model_validate(yaml.safe_load(profile_path(name_or_path).read_text()))


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def dump_profile(profile: Profile, path: Path) -> None:
    path.write_text(yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False,
                                   width=100, allow_unicode=True))
