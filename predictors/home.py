"""Where laneway keeps what it builds, and the datasets that ship with the repository.

`$LANEWAY_HOME` (default `.laneway/` in the checkout) holds built tiny models, trained
predictor artifacts, policy checkpoints, logs and local backends' state. `datasets/`
holds the prompts, answers and arrival traces the project trains and benchmarks on,
gzip-compressed with their licenses (datasets/README.md). A data path may name the
plain file or its `.gz`: `open_text` and `read_bytes` read either, so a path written
as `…/alpaca_eval_experts.jsonl` finds the shipped `…/alpaca_eval_experts.jsonl.gz`.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import TextIO

REPO = Path(__file__).resolve().parents[1]
DATASETS = REPO / "datasets"
ALPACA_EVAL = DATASETS / "data" / "alpaca_eval_experts.jsonl"
# The tiny models' build version (bench/models/tiny_models.py builds them): the length
# predictor counts tokens with the small model's tokenizer when one is built.
TINY_MODEL_BUILD = 2


def laneway_home() -> Path:
    """Where models, logs and backend state live (`$LANEWAY_HOME`, else `.laneway/`)."""
    return Path(os.environ.get("LANEWAY_HOME") or REPO / ".laneway")


def tiny_model_dir(variant: str, root: Path | None = None) -> Path:
    return (root or laneway_home() / "models") / f"{variant}-v{TINY_MODEL_BUILD}"


def data_file(path: Path) -> Path:
    """`path` if it exists, else its gzip-compressed twin `path.gz` if that exists."""
    if path.exists() or path.suffix == ".gz":
        return path
    packed = path.with_name(path.name + ".gz")
    return packed if packed.exists() else path


def open_text(path: Path) -> TextIO:
    """A data file opened for reading text, decompressed when it is gzip."""
    found = data_file(path)
    if found.suffix == ".gz":
        return gzip.open(found, "rt", encoding="utf-8")
    return found.open(encoding="utf-8")


def read_bytes(path: Path) -> bytes:
    """A data file's bytes, decompressed when it is gzip (so its digest is the data's)."""
    found = data_file(path)
    raw = found.read_bytes()
    return gzip.decompress(raw) if found.suffix == ".gz" else raw
