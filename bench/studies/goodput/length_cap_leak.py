"""How much of the true answer length the benchmarks' `max_tokens` gives away.

    python -m bench.studies.goodput.length_cap_leak [--shared datasets] [--out
    docs/results/length_cap_leak.json]

The harness replays a real answer length by asking for exactly that many tokens
(`max_tokens` = the true length, `ignore_eos`), and laneway caps a length prediction
at the request's `max_tokens`. So a goodput benchmark routes on min(predicted, true):
every over-estimate becomes the exact length. This counts how often that happens on
the emulated fleets' workload (alpaca_eval Poisson, gpt-3.5 lengths capped at 512, the
length predictor as `bench_goodput` loads it) and the MAE with and without the cap.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.harness import workloads
from predictors.home import DATASETS, REPO, laneway_home
from predictors.length.data import chat_prompt
from predictors.length.predictor import LengthPredictor, load_artifact
from proxy.types import RequestContext


def predicted_length(predictor: LengthPredictor, model: str, instruction: str) -> float:
    """What the proxy would predict for a one-message chat request, uncapped (no
    max_tokens); ValueError if the predictor has no model for `model`."""
    predicted = predictor.predict(RequestContext(
        request_id="offline", endpoint="chat", model=model,
        prompt_text=chat_prompt(instruction), prompt_blocks=(), stream=True,
        max_tokens=None)).output_tokens
    if predicted is None:
        raise ValueError(f"the predictor has no model for {model!r}")
    return predicted


def measure(shared: Path, requests: int, max_output: int) -> dict[str, float | int]:
    spec = workloads.WorkloadSpec("poisson", shared, n=requests, rate=16.0,
                                  fit=workloads.LengthFit(max_output=max_output))
    expert = spec.expert  # bench_goodput maps its model name to this predictor key
    predictor = load_artifact(laneway_home() / "predictors/length-moe-v1")
    raw_errors, capped_errors, exact = [], [], 0
    for request in workloads.build(spec).requests:
        true = request.max_tokens
        predicted = predicted_length(predictor, expert, request.prompt)
        exact += predicted >= true
        raw_errors.append(abs(predicted - true))
        capped_errors.append(abs(min(predicted, true) - true))
    n = len(raw_errors)
    return {"requests": n, "max_output": max_output,
            "capped_to_the_true_length": round(exact / n, 4),
            "mae_tokens_uncapped": round(statistics.fmean(raw_errors), 1),
            "mae_tokens_capped": round(statistics.fmean(capped_errors), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shared", default=str(DATASETS))
    parser.add_argument("--requests", type=int, default=805)
    parser.add_argument("--max-output", type=int, default=512)
    parser.add_argument("--out", default=str(REPO / "docs/results/length_cap_leak.json"))
    args = parser.parse_args(argv)
    figures = measure(Path(args.shared), args.requests, args.max_output)
    print(json.dumps(figures))
    Path(args.out).write_text(json.dumps(
        {**figures, "command": "python -m bench.studies.goodput.length_cap_leak"}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
