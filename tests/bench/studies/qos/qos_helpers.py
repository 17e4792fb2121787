"""A two-expert qos_drl simulator fleet and prompt pool for the bench tests: a slow
(12-layer) and a fast (2-layer) tiny-llama profile; every prompt scores 0.9 / 0.2 and
needs 60 / 30 tokens on them."""

from __future__ import annotations

from bench.emulator.profile import load_profile
from bench.studies.qos.setup import fit_coefficients
from bench.studies.qos.sim import ExpertSpec, PoolPrompt


def pool(n: int = 20) -> list[PoolPrompt]:
    return [PoolPrompt(i, 20 + i, (0.9, 0.2), (60, 30), (0.85, 0.25), (55.0, 35.0))
            for i in range(n)]


def specs() -> list[ExpertSpec]:
    small = load_profile("tiny-llama-small")
    return [ExpertSpec("slow", load_profile("tiny-llama-large"),
                       fit_coefficients(load_profile("tiny-llama-large"))),
            ExpertSpec("fast", small, fit_coefficients(small))]
