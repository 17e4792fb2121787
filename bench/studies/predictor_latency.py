"""Per-request latency of the length predictor, as the proxy calls it
(predictors/length/latency.py).

`python -m bench.studies.predictor_latency --artifact DIR` (or `laneway evaluate length`,
which records the numbers in docs/results/length_predictor.json). One request at a
time on one thread, like the proxy's request path: TF-IDF encoding + the fused MoE
forward pass, timed with `perf_counter_ns` around `predict` / `predict_window`.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    from predictors.home import DATASETS, open_text
    from predictors.length.data import chat_prompt, is_heldout
    from predictors.length.latency import measure
    from predictors.length.predictor import load_artifact

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--artifact", required=True, type=Path)
    parser.add_argument("--data", type=Path,
                        default=DATASETS / "data" / "alpaca_eval_experts.jsonl")
    parser.add_argument("--model", default="gpt-3.5-turbo-1106", help="predictor key")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import json

    with open_text(args.data) as lines:
        records = [json.loads(line) for line in lines]
    held = [r for r in records if is_heldout(int(r["id"]))]
    prompts = [chat_prompt(r["instruction"]) for r in held]
    answers = [r["experts"][args.model]["output"] for r in held]
    result = measure(load_artifact(args.artifact), args.model, prompts, answers, args.repeats)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
