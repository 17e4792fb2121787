"""ELDR expert signatures (paper: eldr.txt, "Expert Signature").

A request's prefill routing, as per-layer per-expert top-k token counts c[l, e]
(what the laneway_eldr vLLM plugin reports), becomes a vector whose cosine distance
to another request's predicts how differently the two will use experts while
decoding: counts x IDF over a calibration set, only the layers a greedy search finds
informative (max Spearman rho against decode activations), L2-normalized.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Kind = Literal["count_idf", "gate_prob", "binary"]
KINDS: tuple[Kind, ...] = ("count_idf", "gate_prob", "binary")


def idf(counts: np.ndarray) -> np.ndarray:
    """w(l, e) = log((|C| + 1) / (df(l, e) + 1)); `counts` is [requests, layers, experts]."""
    df = (counts > 0).sum(axis=0)
    weights: np.ndarray = np.log((counts.shape[0] + 1) / (df + 1.0))
    return weights


def normalize(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    out: np.ndarray = rows / np.where(norms > 0, norms, 1.0)
    return out


@dataclass(frozen=True, slots=True)
class SignatureSpec:
    """How to turn counts into a signature: IDF weights [layers, experts], kept layers."""

    weights: np.ndarray
    layers: tuple[int, ...]

    def embed(self, counts: np.ndarray) -> np.ndarray:
        """[.., layers, experts] counts -> [.., len(layers) * experts] unit vectors."""
        weighted: np.ndarray = (counts * self.weights)[..., list(self.layers), :]
        return normalize(weighted.reshape(*weighted.shape[:-2], -1))


def features(kind: Kind, counts: np.ndarray, gate_probs: np.ndarray | None = None
             ) -> np.ndarray:
    """The per-(layer, expert) input of a signature kind, [requests, layers, experts]."""
    if kind == "count_idf":
        weighted: np.ndarray = counts * idf(counts)
        return weighted
    if kind == "binary":
        return (counts > 0).astype(np.float64)
    if gate_probs is None:
        raise ValueError("gate_prob signatures need the gate probabilities")
    return gate_probs


def cosine_distances(rows: np.ndarray) -> np.ndarray:
    """Condensed (upper-triangle) pairwise cosine distances of [n, d] rows."""
    unit = normalize(rows)
    upper = np.triu_indices(len(rows), k=1)
    out: np.ndarray = 1.0 - (unit @ unit.T)[upper]
    return out


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def decode_profile(decode_counts: np.ndarray) -> np.ndarray:
    """p_i: decode-time activation probability per (layer, expert), flattened."""
    totals = decode_counts.sum(axis=-1, keepdims=True)
    probs = decode_counts / np.where(totals > 0, totals, 1)
    out: np.ndarray = probs.reshape(len(decode_counts), -1)
    return out


def rho(signature_input: np.ndarray, decode_counts: np.ndarray,
        layers: Sequence[int] | None = None) -> float:
    """Spearman rho between signature and decode-activation cosine distances."""
    chosen = signature_input if layers is None else signature_input[:, list(layers)]
    vectors = chosen.reshape(len(chosen), -1)
    return spearman(cosine_distances(vectors),
                    cosine_distances(decode_profile(decode_counts)))


def select_layers(signature_input: np.ndarray, decode_counts: np.ndarray
                  ) -> tuple[tuple[int, ...], list[float]]:
    """Greedy layer mask: add the layer that raises rho most; keep the peak prefix.

    Returns the kept layers and rho after each addition (the paper's Fig. 8 curve)."""
    remaining = list(range(signature_input.shape[1]))
    order: list[int] = []
    curve: list[float] = []
    while remaining:
        scores = [rho(signature_input, decode_counts, [*order, layer]) for layer in remaining]
        best = int(np.nanargmax(scores))
        order.append(remaining.pop(best))
        curve.append(scores[best])
    peak = int(np.nanargmax(curve)) + 1
    return tuple(sorted(order[:peak])), curve


def fit_signature(counts: np.ndarray, decode_counts: np.ndarray | None = None
                  ) -> tuple[SignatureSpec, list[float]]:
    """IDF over `counts` [requests, layers, experts]; layers chosen when decode
    counts of the same requests are given, else all layers."""
    weights = idf(counts)
    if decode_counts is None:
        return SignatureSpec(weights, tuple(range(counts.shape[1]))), []
    layers, curve = select_layers(counts * weights, decode_counts)
    return SignatureSpec(weights, layers), curve
