"""Micro-benchmark of the `disco` policy off and on the request path: `pick` (a table
lookup) and the table recompute for windows of 1k, 10k and 100k samples (the paper's
Figure 9 times its solvers at those sizes: 0.1-15 ms on an M1).

    python -m bench.studies.disco.pick_latency
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from types import MappingProxyType

import numpy as np

from policies.base import build_policy
from policies.disco import Disco
from proxy.request_context import prefix_blocks
from proxy.types import NO_PREDICTION, Backend, ClusterView, RequestContext

FLEET = ClusterView(
    (Backend("phone", "http://phone", "m", MappingProxyType({"side": "device"})),
     Backend("cloud", "http://cloud", "m", MappingProxyType({"side": "server"}))),
    {}, {}, 0.0)


def requests(n: int, seed: int = 0) -> list[RequestContext]:
    words = np.random.default_rng(seed).lognormal(np.log(25), 0.8, n).astype(int) + 1
    return [RequestContext(request_id=str(i), endpoint="chat", model="m",
                           prompt_text="w " * int(w), prompt_blocks=prefix_blocks("w", 16),
                           stream=True, max_tokens=128) for i, w in enumerate(words)]


def primed(window: int, mode: str) -> Disco:
    with tempfile.TemporaryDirectory() as tmp:
        prior = Path(tmp) / "ttft.json"
        prior.write_text(json.dumps(np.random.default_rng(1).lognormal(
            np.log(0.7), 0.8, window).tolist()))
        policy = build_policy("disco", {"ttft_prior": str(prior), "mode": mode,
                                        "ttft_window": window, "length_window": window,
                                        "recompute_every": 10**6})
    assert isinstance(policy, Disco)
    for ctx in requests(window, seed=2):
        policy.pick(ctx, NO_PREDICTION, FLEET)
    return policy


def pick_latency(picks: int = 10_000, window: int = 2000) -> dict[str, float]:
    """p50/p99 of one `pick` in ms, DiSCo-D and DiSCo-S mixed."""
    samples: list[float] = []
    for mode in ("device", "server"):
        policy = primed(window, mode)
        policy.recompute()
        for ctx in requests(picks // 2, seed=3):
            begin = time.perf_counter_ns()
            policy.pick(ctx, NO_PREDICTION, FLEET)
            samples.append((time.perf_counter_ns() - begin) / 1e6)
    return {"pick_p50_ms": float(np.quantile(samples, 0.5)),
            "pick_p99_ms": float(np.quantile(samples, 0.99))}


def recompute_latency(windows: tuple[int, ...] = (1000, 10_000, 100_000)
                      ) -> dict[str, float]:
    """Median ms of one `recompute` (both tables) per window size."""
    out: dict[str, float] = {}
    for window in windows:
        policy = primed(window, "device")
        times = []
        for _ in range(5):
            begin = time.perf_counter_ns()
            policy.recompute()
            times.append((time.perf_counter_ns() - begin) / 1e6)
        out[f"recompute_ms_{window}"] = float(np.median(times))
    return out


def main() -> None:
    print(json.dumps({**pick_latency(), **recompute_latency()}, indent=1))


if __name__ == "__main__":
    main()
