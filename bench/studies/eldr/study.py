"""Does ELDR's premise hold on the tiny MoE? (paper: Fig. 3, Fig. 4, Fig. 7)

From direct router traces (bench/models/moe_trace.py) of domain-labelled prompts:
* prefill-vs-decode correlation of per-expert activation, per request and per domain;
* distinct experts per decode step (mean over layers) for batches of one domain
  vs mixed batches (routing is per token, so a batch's union is exact offline);
* Spearman rho of each signature kind (count x IDF, gate probability, binary),
  with all layers and with the greedy layer mask.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.models.moe_trace import MoeTracer
from predictors.eldr.experts import KINDS, features, idf, rho, select_layers


@dataclass(frozen=True, slots=True)
class Traces:
    domains: list[str]
    prefill: np.ndarray  # [n, layers, experts] top-k token counts
    gate_probs: np.ndarray  # [n, layers, experts] gate probability summed over tokens
    decode_ids: list[np.ndarray]  # per request [layers, steps, k]
    experts: int

    @property
    def decode(self) -> np.ndarray:
        return np.stack([np.stack([np.bincount(ids[layer].ravel(), minlength=self.experts)
                                   for layer in range(len(ids))]) for ids in self.decode_ids])

    def to_jsonl(self, path: Path) -> None:
        """Calibration records in the plugin's shape (`prefill`, `decode` counts)."""
        with path.open("w") as out:
            for domain, prefill, decode in zip(self.domains, self.prefill, self.decode,
                                               strict=True):
                out.write(json.dumps({"domain": domain, "prefill": prefill.tolist(),
                                      "decode": decode.tolist()}) + "\n")


def trace_prompts(tracer: MoeTracer, pairs: Sequence[tuple[str, str]], decode_tokens: int,
                  max_prompt_tokens: int = 256) -> Traces:
    domains, prefill, probs, decode = [], [], [], []
    for domain, text in pairs:
        trace = tracer.trace(tracer.encode(text)[:max_prompt_tokens], decode_tokens)
        domains.append(domain)
        prefill.append(trace.counts(tracer.experts))
        probs.append(trace.prefill_probs.sum(axis=1))
        decode.append(trace.decode_ids)
    return Traces(domains, np.stack(prefill), np.stack(probs), decode, tracer.experts)


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a.ravel(), b.ravel())[0, 1])


def prefill_decode_correlation(traces: Traces) -> dict[str, float]:
    decode = traces.decode
    per_request = [_pearson(p, d) for p, d in zip(traces.prefill, decode, strict=True)]
    out = {"per_request_mean": float(np.nanmean(per_request))}
    for domain in sorted(set(traces.domains)):
        rows = [i for i, d in enumerate(traces.domains) if d == domain]
        out[f"domain:{domain}"] = _pearson(traces.prefill[rows].sum(0), decode[rows].sum(0))
    return out


def batch_active_experts(traces: Traces, batch: int, rng: random.Random) -> float:
    """Mean over steps and layers of the union of experts `batch` requests use."""
    ids = traces.decode_ids
    union = np.zeros((ids[0].shape[0], ids[0].shape[1], traces.experts), bool)
    for request in rng.sample(range(len(ids)), batch) if batch else []:
        layer = np.arange(union.shape[0])[:, None, None]
        step = np.arange(union.shape[1])[None, :, None]
        union[layer, step, ids[request]] = True
    return float(union.sum(axis=2).mean())


def same_vs_mixed(traces: Traces, batch: int = 8, samples: int = 200, seed: int = 0
                  ) -> dict[str, float]:
    rng = random.Random(seed)
    by_domain = {d: [i for i, x in enumerate(traces.domains) if x == d]
                 for d in set(traces.domains)}
    same, mixed = [], []
    for _ in range(samples):
        rows = by_domain[rng.choice(sorted(by_domain))]
        same.append(_union_of(traces, rng.sample(rows, batch)))
        mixed.append(_union_of(traces, rng.sample(range(len(traces.domains)), batch)))
    return {"batch": batch, "same_domain": float(np.mean(same)),
            "mixed": float(np.mean(mixed)),
            "reduction": float(1 - np.mean(same) / np.mean(mixed))}


def _union_of(traces: Traces, rows: Sequence[int]) -> float:
    first = traces.decode_ids[rows[0]]
    union = np.zeros((first.shape[0], first.shape[1], traces.experts), bool)
    layer = np.arange(first.shape[0])[:, None, None]
    step = np.arange(first.shape[1])[None, :, None]
    for row in rows:
        union[layer, step, traces.decode_ids[row]] = True
    return float(union.sum(axis=2).mean())


def signature_quality(traces: Traces) -> dict[str, Any]:
    decode = traces.decode
    out: dict[str, Any] = {}
    for kind in KINDS:
        inputs = features(kind, traces.prefill, traces.gate_probs)
        layers, curve = select_layers(inputs, decode)
        out[kind] = {"rho_all_layers": rho(inputs, decode), "rho_selected": rho(
            inputs, decode, layers), "layers": list(layers), "greedy_curve": curve}
    out["idf_range"] = [float(idf(traces.prefill).min()), float(idf(traces.prefill).max())]
    return out
