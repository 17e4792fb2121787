"""Signature quality and the paper's premise, from the plugin's records.

`signature_rhos`: Spearman rho (predictors/eldr/experts.py) of count x IDF and binary
signatures from the vLLM prefill counts, and of gate-probability signatures from a
transformers forward of the same weights on the same prompts (the plugin records
top-k ids, not probabilities), each against the vLLM decode counts.
`premise`: prefill-vs-decode activation correlation (vLLM records), and distinct
experts per decode step for same-domain vs mixed batches of 8 (per-step routing from
transformers greedy decoding: the plugin aggregates decode counts per request).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench.models.moe_trace import MoeTracer
from bench.models.tiny_models import ensure_model
from bench.studies.eldr.study import (
    Traces,
    prefill_decode_correlation,
    same_vs_mixed,
    trace_prompts,
)
from predictors.eldr.experts import KINDS, features, rho, select_layers


def _tracer(shared: str, variant: str) -> MoeTracer:
    return MoeTracer(ensure_model(variant, Path(shared)), dtype="float32")


def signature_rhos(records: list[dict[str, Any]], prompts: list[str], shared: str,
                   variant: str = "moe") -> dict[str, Any]:
    """`variant`: the tiny MoE the records came from (its weights give the gate probs)."""
    tracer = _tracer(shared, variant)
    prefill = np.array([r["prefill"] for r in records], float)
    decode = np.array([r["decode"] for r in records], float)
    gate = np.stack([tracer.trace(tracer.encode(p)).prefill_probs.sum(axis=1)
                     for p in prompts])
    out: dict[str, Any] = {}
    for kind in KINDS:
        inputs = features(kind, prefill, gate)
        layers, curve = select_layers(inputs, decode)
        out[kind] = {"all_layers": rho(inputs, decode), "selected": rho(inputs, decode, layers),
                     "layers": list(layers), "greedy_curve": curve}
    return out


def premise(records: list[dict[str, Any]], shared: str, prompts: list[tuple[str, str]],
            per_domain: int = 12, decode_tokens: int = 16, variant: str = "moe"
            ) -> dict[str, Any]:
    prefill = np.array([r["prefill"] for r in records], float)
    decode = np.array([r["decode"] for r in records], float)
    fake = Traces([r["domain"] for r in records], prefill, prefill, [], int(prefill.shape[2]))
    vllm_corr = _correlations(fake, decode)
    chosen: list[tuple[str, str]] = []
    for domain in sorted({d for d, _ in prompts}):
        chosen += [(d, p) for d, p in prompts if d == domain][:per_domain]
    traces = trace_prompts(_tracer(shared, variant), chosen, decode_tokens)
    return {"prefill_decode_correlation_vllm": vllm_corr,
            "prefill_decode_correlation_transformers": prefill_decode_correlation(traces),
            "batch_active_experts_transformers": same_vs_mixed(traces)}


def _correlations(traces: Traces, decode: np.ndarray) -> dict[str, float]:
    per_request = [float(np.corrcoef(p.ravel(), d.ravel())[0, 1])
                   for p, d in zip(traces.prefill, decode, strict=True)]
    out = {"per_request_mean": float(np.nanmean(per_request))}
    for domain in sorted(set(traces.domains)):
        rows = [i for i, d in enumerate(traces.domains) if d == domain]
        out[f"domain:{domain}"] = float(np.corrcoef(traces.prefill[rows].sum(0).ravel(),
                                                    decode[rows].sum(0).ravel())[0, 1])
    return out
