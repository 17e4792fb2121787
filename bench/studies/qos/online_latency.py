"""What online learning costs a qos_drl decision (issue 8, point 5): the wall time of
`pick` on the trained checkpoint with `learn_online` off, on with the SAC updates
inline in the decision (`online_thread: false`), and on with them in the policy's own
thread (the default), at a steady arrival rate so the thread trains between and during
decisions, as in the proxy (where `pick` runs on the event loop: its time is time every
relayed stream waits). Six experts on one backend each, their stats fixed, the
policy's own book of routed requests filling the state graph as it would live.

    python -m bench.studies.qos.online_latency [--checkpoint …/best.pt] [--decisions 400] [--rate
    20]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench.harness.results import write_json
from bench.studies.qos.latency import ms
from policies.base import build_policy
from policies.qos_drl.policy import QosDrl
from predictors.home import laneway_home
from proxy.request_context import prefix_blocks
from proxy.types import NO_PREDICTION, Backend, BackendStats, ClusterView, RequestContext

MODES: dict[str, dict[str, Any]] = {
    "off": {},
    "inline": {"learn_online": True, "online_thread": False},
    "thread": {"learn_online": True, "online_thread": True},
}


def decide(policy: QosDrl, n: int, rate: float) -> list[float]:
    backends = tuple(Backend(f"b{i}", f"http://b{i}", e) for i, e in enumerate(policy.experts))
    stats = {b.name: BackendStats(running=4, waiting=1, kv_usage=0.4, tpot_s=0.02,
                                  healthy=True, updated_at=1.0) for b in backends}
    prompt = "Explain how a routing proxy spreads requests over several models. " * 4
    took = []
    start = time.monotonic()
    for i in range(n):
        time.sleep(max(0.0, start + i / rate - time.monotonic()))
        ctx = RequestContext(request_id=f"r{i}", endpoint="chat", model="experts",
                             prompt_text=prompt, prompt_blocks=prefix_blocks(prompt, 128),
                             stream=True, max_tokens=256)
        view = ClusterView(backends, stats, {}, time.monotonic())
        t = time.perf_counter()
        policy.pick(ctx, NO_PREDICTION, view)
        took.append(1000 * (time.perf_counter() - t))
    return took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path,
                        default=laneway_home() / "policies" / "qos-drl-v1" / "best.pt")
    parser.add_argument("--decisions", type=int, default=400)
    parser.add_argument("--rate", type=float, default=20.0, help="decisions per second")
    parser.add_argument("--warmup", type=int, default=32, help="online_warmup")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"checkpoint": str(args.checkpoint), "rate": args.rate,
                              "decisions": args.decisions, "online_warmup": args.warmup}
    for mode, params in MODES.items():
        online = {"online_warmup": args.warmup} if params else {}
        policy = build_policy("qos_drl", {"checkpoint": str(args.checkpoint), **params,
                                          **online})
        assert isinstance(policy, QosDrl)
        took = decide(policy, args.decisions, args.rate)[args.warmup + 1:]  # updates on
        learner = policy.learner
        if learner is not None:
            learner.wait_idle(60)  # the thread's owed updates, to count them all
        result[mode] = {"p50_ms": ms(took, 0.5), "p99_ms": ms(took, 0.99),
                        "updates": learner.updates if learner else 0,
                        "skipped": learner.skipped if learner else 0}
        print(f"{mode:7s} decision p50 {result[mode]['p50_ms']:.2f} ms, "
              f"p99 {result[mode]['p99_ms']:.2f} ms, updates {result[mode]['updates']}")
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
