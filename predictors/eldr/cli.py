"""`laneway train eldr`: fit ELDR's decode centroids from calibration signatures.

The calibration file is JSONL of the laneway_eldr plugin's request records
(`GET /eldr/requests/<id>`: `prefill` counts, and `decode` counts when the request
decoded; with decode counts the layer mask is chosen by rho, else all layers are
kept). Run it again on fresh records to refit after workload drift; the proxy picks
the new artifact up on its next start (or config reload).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from predictors.home import laneway_home


def default_artifact() -> Path:
    return laneway_home() / "predictors" / "eldr"


def _train(args: argparse.Namespace) -> int:
    from predictors.eldr.fit import fit, read_calibration, save

    prefill, decode = read_calibration(args.calibration)
    workers: int | list[str] = (int(args.workers) if args.workers.isdigit()
                                else args.workers.split(","))
    model, report = fit(prefill, decode, workers, seed=args.seed)
    path = save(model, report, args.out)
    print(json.dumps({"artifact": str(path), **report}))
    return 0


def add_train(train: Any) -> None:
    eldr = train.add_parser("eldr", help="ELDR balanced k-means over expert signatures")
    eldr.add_argument("--calibration", type=Path, required=True,
                      help="JSONL of the ELDR plugin's request records")
    eldr.add_argument("--workers", required=True,
                      help="decode workers: a count, or backend names (comma-separated)")
    eldr.add_argument("--out", type=Path, default=default_artifact())
    eldr.add_argument("--seed", type=int, default=0)
    eldr.set_defaults(func=_train)
