"""Solo latencies: the base of every request's end-to-end SLO.

GoodServe sets a request's SLO to scale x the latency it has when run alone (scales
1, 1.5, 2, 2.5, 3). `python -m bench solo` measures that by sending a workload's
requests one at a time, with no other load, straight to one backend (use the
fastest); its result file is an ordinary run file. Here, a request's solo latency is
the median over every successful solo measurement of its `id` (same id = same prompt
and max_tokens). Requests never measured (a calibration sample was run instead of the
whole workload) get a least-squares fit over the measured ones:
solo ≈ a + b·prompt_tokens + c·output_tokens.

Two readings of the paper's rule ("we first measure the median request execution time
by running each request alone on a mid-tier GPU, and then scale that base latency"):
`request` (each request's SLO is scale x its own solo latency) and `median` (one base
for every request: the median of the measured solo latencies, so a long answer gets the
same deadline as a short one, and only fast backends meet it).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from bench.harness.results import RequestResult

DEFAULT_SCALES = (1.0, 1.5, 2.0, 2.5, 3.0)
SLO_BASES = ("request", "median")


@dataclass(frozen=True, slots=True)
class SoloLatencies:
    measured: Mapping[str, float]  # request id → median solo end-to-end latency (s)
    coef: tuple[float, float, float] | None = None  # (a, b, c) of the fit, if any
    uniform: float | None = None  # one base for every request (`median`), if set

    @classmethod
    def from_results(cls, results: Iterable[RequestResult]) -> SoloLatencies:
        samples: dict[str, list[float]] = defaultdict(list)
        shapes: dict[str, tuple[int, int]] = {}
        for r in results:
            if r.ok and r.prompt_tokens is not None and r.output_tokens is not None:
                samples[r.id].append(r.e2e_s)
                shapes[r.id] = (r.prompt_tokens, r.output_tokens)
        measured = {key: statistics.median(values) for key, values in samples.items()}
        return cls(measured, _fit(measured, shapes))

    def based_on(self, base: str) -> SoloLatencies:
        """These latencies under an SLO base of `SLO_BASES`."""
        if base == "request":
            return self
        if base != "median":
            raise ValueError(f"unknown SLO base {base!r} (one of {', '.join(SLO_BASES)})")
        if not self.measured:
            raise ValueError("no solo latency measured: no median to base SLOs on")
        return dataclasses.replace(self, uniform=statistics.median(self.measured.values()))

    def of(self, result: RequestResult) -> float | None:
        """A finished request's solo latency: measured, else fitted from its usage."""
        return self.estimate(result.id, result.prompt_tokens, result.output_tokens)

    def estimate(self, request_id: str, prompt_tokens: int | None,
                 output_tokens: int | None) -> float | None:
        """The uniform base if set; else measured if `request_id` was, else fitted
        (needs both token counts)."""
        if self.uniform is not None:
            return self.uniform
        if request_id in self.measured:
            return self.measured[request_id]
        if self.coef is None or prompt_tokens is None or output_tokens is None:
            return None
        a, b, c = self.coef
        return a + b * prompt_tokens + c * output_tokens


def _fit(measured: Mapping[str, float], shapes: Mapping[str, tuple[int, int]]
         ) -> tuple[float, float, float] | None:
    if len(measured) < 3:
        return None
    keys = sorted(measured)
    import numpy as np  # (here: `bench.harness.cli`, built at every start, reads SLO_BASES)

    design = np.array([[1.0, *shapes[k]] for k in keys])
    target = np.array([measured[k] for k in keys])
    solution = np.linalg.lstsq(design, target, rcond=None)[0]
    return float(solution[0]), float(solution[1]), float(solution[2])
