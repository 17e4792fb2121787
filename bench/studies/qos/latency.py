"""Decision latency of `qos_drl` as the proxy runs it (issue 8: ≤ 5 ms with predictors;
the bucket predictor ≤ 10 ms p50 with batching across concurrent arrivals).

    python -m bench.studies.qos.latency [--runtime onnx-int8] [--rates 5 20 50]  # merges into
    qos_drl.json
    python -m bench.studies.qos.latency --buckets DIR --max-len 64 --out /tmp/qos.json  # a new file

On one CPU thread for the agent and one for the encoder, 6 expert backends, held-out
prompts:

* `agent_only`: `QosDrl.pick` with the predictions given (state + HAN + actor);
* `inline`: `pick` computing the predictions itself, one request at a time (what a
  caller without the proxy's stage gets);
* `arrivals`: the proxy's path, per Poisson rate λ: the bucket stage
  (`proxy/routing/stages.py`: encoder in a worker thread, arrivals during a batch go together
  in the next one) then `pick`; per request the stage's wait and the whole decision.

`decision_p50_ms` in qos_drl.json is the whole decision at the reference λ (5 req/s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness.report import pct
from bench.studies.qos.train import default_checkpoint
from predictors.base import BUCKET_RUNTIMES, BucketRuntime
from predictors.buckets.cli import distilled_artifact
from predictors.home import ALPACA_EVAL, REPO

RESULTS = REPO / "docs" / "results"
RATES = (5.0, 20.0, 50.0)


def ms(values: Sequence[float], q: float) -> float:
    return round(pct(values, q), 3)


class Bench:
    def __init__(self, checkpoint: Path, buckets: Path, runtime: BucketRuntime,
                 max_len: int | None = None, threads: int = 1) -> None:
        from policies.qos_drl.policy import QosDrl, QosDrlParams
        from proxy.types import Backend, BackendStats

        self.policy = QosDrl(QosDrlParams(checkpoint=str(checkpoint), buckets=str(buckets),
                                          buckets_runtime=runtime, buckets_max_len=max_len,
                                          buckets_threads=threads))
        self.backends = tuple(Backend(f"b{i}", f"http://b{i}", e)
                              for i, e in enumerate(self.policy.experts))
        self.stats = {b.name: BackendStats(running=3, waiting=1, kv_usage=0.3, tpot_s=0.02,
                                           healthy=True, updated_at=1.0)
                      for b in self.backends}
        self._n = 0

    def context(self, prompt: str) -> Any:
        from proxy.types import RequestContext

        self._n += 1
        return RequestContext(f"r{self._n}", "chat", "qos", prompt, (), True, 256)

    def pick(self, ctx: Any, pred: Any) -> None:
        from proxy.types import ClusterView

        self.policy.pick(ctx, pred, ClusterView(self.backends, self.stats, {},
                                                time.monotonic()))
        self.policy.book.finished(ctx.request_id)  # keep the in-flight book small

    def timed(self, prompts: Sequence[str], given: bool) -> list[float]:
        from proxy.types import NO_PREDICTION, Prediction

        out = []
        n = len(self.policy.experts)
        staged = Prediction(expert_scores=(0.5,) * n, expert_lengths=(200.0,) * n)
        for prompt in prompts:
            ctx = self.context(prompt)
            started = time.perf_counter()
            self.pick(ctx, staged if given else NO_PREDICTION)
            out.append((time.perf_counter() - started) * 1000)
        return out[5:]

    async def arrivals(self, prompts: Sequence[str], rate: float, seed: int
                       ) -> dict[str, float]:
        from proxy.routing.stage_builder import stages_for
        from proxy.routing.stages import BucketStage
        from proxy.types import NO_PREDICTION, ClusterView

        [stage] = stages_for(self.policy)
        assert isinstance(stage, BucketStage)
        view = ClusterView(self.backends, self.stats, {}, 0.0)
        waits: list[float] = []
        totals: list[float] = []

        async def one(prompt: str) -> None:
            ctx = self.context(prompt)
            started = time.perf_counter()
            pred = await stage.predict(ctx, {}, NO_PREDICTION, view)
            waits.append((time.perf_counter() - started) * 1000)
            self.pick(ctx, pred)
            totals.append((time.perf_counter() - started) * 1000)

        rng = random.Random(seed)
        await one(prompts[0])  # warm-up: the worker thread starts
        waits.clear()
        totals.clear()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        await stage.close()
        return {"rate": rate, "requests": len(totals),
                "stage_p50_ms": ms(waits, 0.5), "stage_p99_ms": ms(waits, 0.99),
                "decision_p50_ms": ms(totals, 0.5), "decision_p99_ms": ms(totals, 0.99),
                "mean_batch": round(stage.batcher.items / max(1, stage.batcher.batches), 2)}


def measure(prompts: Sequence[str], checkpoint: Path, buckets: Path, runtime: BucketRuntime,
            rates: Sequence[float], reference: float, max_len: int | None = None,
            threads: int = 1) -> dict[str, Any]:
    """`max_len`, `threads`: qos_drl's buckets_max_len, buckets_threads."""
    import torch

    torch.set_num_threads(1)
    timer = Bench(checkpoint, buckets, runtime, max_len, threads)
    timer.timed(prompts[:10], given=False)  # warm-up
    agent = timer.timed(prompts, given=True)
    inline = timer.timed(prompts, given=False)
    under = [asyncio.run(timer.arrivals(prompts, rate, seed=int(rate)))
             for rate in sorted({*rates, reference})]  # the reference rate always
    ref = next(row for row in under if row["rate"] == reference)
    agent_p50 = round(statistics.median(agent), 3)
    return {"decision_p50_ms": ref["decision_p50_ms"], "decision_p99_ms": ref["decision_p99_ms"],
            "agent_only_p50_ms": agent_p50,
            "decision_latency": {
                "predictor_runtime": runtime, "predictor_artifact": buckets.name,
                "predictor_max_len": timer.policy.predictor.max_len,
                "predictor_threads": threads, "reference_rate": reference,
                "agent_only_p50_ms": agent_p50,
                "agent_only_p99_ms": ms(agent, 0.99),
                "inline_p50_ms": round(statistics.median(inline), 3),
                "inline_p99_ms": ms(inline, 0.99), "arrivals": under}}


def markdown(result: dict[str, Any]) -> str:
    d = result["decision_latency"]
    rows = "; ".join(f"λ={r['rate']:g}: stage p50 {r['stage_p50_ms']:.1f} ms, decision p50 "
                     f"{r['decision_p50_ms']:.1f} / p99 {r['decision_p99_ms']:.1f} ms "
                     f"(mean batch {r['mean_batch']:.2f})" for r in d["arrivals"])
    return (f"Decision latency (CPU, one thread for the agent, "
            f"{d['predictor_threads']} for the {d['predictor_runtime']} encoder "
            f"{d['predictor_artifact']}, prompts cut to {d['predictor_max_len']} tokens): "
            "agent alone p50 "
            f"{d['agent_only_p50_ms']:.2f} ms; predictor inline p50 {d['inline_p50_ms']:.1f} "
            f"ms; through the bucket stage under Poisson arrivals: {rows}")


def heldout_prompts(data: Path, n: int) -> list[str]:
    """The held-out split's prompts (`id % 5 == 0`), as every qos evaluation uses."""
    from predictors.buckets.data import load_rows, split
    from predictors.length.data import token_counter

    _, rows = load_rows(data, token_counter("words"))
    return [r.prompt for r in split(rows)[1]][:n]


def add_runtime_argument(parser: argparse.ArgumentParser) -> None:
    from policies.qos_drl.policy import QosDrlParams

    parser.add_argument("--runtime", choices=BUCKET_RUNTIMES,
                        default=QosDrlParams.model_fields["buckets_runtime"].default,
                        help="how the encoder runs (qos_drl's buckets_runtime; default: "
                        "the policy's)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=ALPACA_EVAL)
    parser.add_argument("--buckets", type=Path, default=distilled_artifact())
    parser.add_argument("--checkpoint", type=Path, default=default_checkpoint(False))
    add_runtime_argument(parser)
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES))
    parser.add_argument("--reference-rate", type=float, default=5.0)
    parser.add_argument("--prompts", type=int, default=160)
    parser.add_argument("--max-len", type=int, default=None,
                        help="cut prompts to N tokens (qos_drl's buckets_max_len)")
    parser.add_argument("--threads", type=int, default=1,
                        help="the encoder's ORT threads (qos_drl's buckets_threads)")
    parser.add_argument("--out", type=Path, default=RESULTS / "qos_drl.json",
                        help="merged into when it exists, else written")
    args = parser.parse_args(argv)
    if args.reference_rate not in args.rates:
        parser.error("--reference-rate must be one of --rates")
    result = measure(heldout_prompts(args.data, args.prompts), args.checkpoint, args.buckets,
                     args.runtime, args.rates, args.reference_rate, args.max_len, args.threads)
    print(markdown(result))
    merged = json.loads(args.out.read_text()) | result if args.out.exists() else result
    args.out.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
