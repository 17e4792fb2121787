"""ELDR signatures: IDF, rho, greedy layer selection (synthetic routing)."""

from __future__ import annotations

import numpy as np

from predictors.eldr.experts import fit_signature, idf, rho, select_layers

EXPERTS = 8


def synthetic(n: int = 60, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Layer 0 routes by domain (and decode follows it), layer 1 is noise."""
    rng = np.random.default_rng(seed)
    domains = rng.integers(0, 2, n)
    prefill = np.zeros((n, 2, EXPERTS))
    decode = np.zeros((n, 2, EXPERTS))
    for i, domain in enumerate(domains):
        favoured = np.arange(4) + 4 * domain
        prefill[i, 0] = rng.poisson(1.0, EXPERTS)
        prefill[i, 0, favoured] += rng.poisson(6.0, 4)
        prefill[i, 1] = rng.poisson(3.0, EXPERTS)
        decode[i, 0] = rng.poisson(0.5, EXPERTS)
        decode[i, 0, favoured] += rng.poisson(3.0, 4)
        decode[i, 1] = 2.0  # decode differs only where the prefill is informative
    return prefill, decode


def test_idf_downweights_experts_every_request_uses() -> None:
    counts = np.zeros((4, 1, 3))
    counts[:, 0, 0] = 5  # everyone
    counts[0, 0, 1] = 1  # one request
    weights = idf(counts)
    assert weights[0, 0] == np.log(5 / 5) and weights[0, 1] == np.log(5 / 2)
    assert weights[0, 2] == np.log(5 / 1)


def test_rho_is_high_for_informative_signatures_and_not_for_shuffled_ones() -> None:
    prefill, decode = synthetic()
    assert rho(prefill, decode) > 0.3
    shuffled = decode[np.random.default_rng(1).permutation(len(decode))]
    assert abs(rho(prefill, shuffled)) < 0.1


def test_greedy_selection_keeps_the_informative_layer() -> None:
    prefill, decode = synthetic()
    layers, curve = select_layers(prefill, decode)
    assert layers == (0,) and curve[0] == max(curve)
    spec, _ = fit_signature(prefill, decode)
    vectors = spec.embed(prefill)
    assert vectors.shape == (60, EXPERTS)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0)
