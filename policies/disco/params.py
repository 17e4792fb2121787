"""The `disco` policy's parameters (docs/disco.md has the table with units)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from policies.base import PARAMS_CONFIG
from policies.disco.cost import Mode

Strategy = Literal["disco", "stoch", "server_only", "device_only"]


class Price(BaseModel):
    """One side's cost per token: prefill (prompt) and decode (generated)."""

    model_config = PARAMS_CONFIG
    prefill: float = Field(ge=0, le=1e9)
    decode: float = Field(ge=0, le=1e9)


class DiscoParams(BaseModel):
    model_config = PARAMS_CONFIG
    strategy: Strategy = Field("disco", description="disco, or a baseline: stoch "
                               "(Stoch-S/-D), server_only (vLLM), device_only (llama.cpp)")
    migration: bool = Field(True, description="token-level migration (disco only)")
    mode: Mode = Field("auto", description="constrained side; auto: Algorithm 1")
    budget: float = Field(0.3, ge=0, le=1, description="b: share of prompt tokens the "
                          "constrained side may process")
    tail_ratio: float = Field(0.05, gt=0, lt=1, description="alpha: budget kept for the tail")
    exchange_rate: float | None = Field(None, ge=0, le=1e9, description="λ, $ per MJ; "
                                        "unset: 5 device-constrained, 0.3 server")
    server_cost: Price = Field(Price(prefill=0.15, decode=0.60),
                               description="$ per 1M tokens (GPT-4o-mini, Table 8)")
    device_cost: Price = Field(Price(prefill=0.16, decode=0.36),
                               description="J per token (5 W at 31.3/13.9 tokens/s)")
    read_rate: float = Field(5.0, ge=0, le=1000, description="r_c tokens/s; 0: machine")
    migration_quantile: float = Field(0.9, gt=0, lt=1, description="t_m: this quantile "
                                      "of the server's TTFT when it is the target")
    device_prefill_tps: float = Field(31.32, gt=0, le=1e6, description="T_d prior: 1/k")
    device_overhead_s: float = Field(0.0, ge=0, le=3600, description="T_d prior: c")
    ttft_prior: str | None = Field(None, description="JSON list of server TTFTs (s)")
    ttft_window: int = Field(2000, ge=1, le=1_000_000)
    length_window: int = Field(2000, ge=1, le=1_000_000)
    device_window: int = Field(200, ge=2, le=1_000_000)
    min_ttft_samples: int = Field(20, ge=1, le=1_000_000, description="F samples "
                                  "before DiSCo-D hedges (before: server alone)")
    recompute_every: int = Field(50, ge=1, le=1_000_000, description="outcomes per "
                                 "table recompute (recompute_interval_s 0 only)")
    recompute_interval_s: float = Field(1.0, ge=0, le=3600, description="seconds "
                                        "between the proxy's background recomputes; "
                                        "0: in observe, every recompute_every outcomes")
    tokens_per_word: float = Field(1.3, gt=0, le=100, description="prompt tokens per word")
    default_output_tokens: int = Field(128, ge=0, le=1_000_000, description="l_remaining "
                                       "when neither a prediction nor max_tokens says")
    seed: int | None = Field(None, description="for Stoch and the boundary length's draw")
