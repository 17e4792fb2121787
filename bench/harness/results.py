"""Benchmark result files: JSONL, one `{"type": "run", ...}` header line, then one
`{"type": "request", ...}` line per request sent, in completion order.

All times are seconds. `arrival_s` and `sent_s` are offsets from the run's start;
`ttft_s`, `e2e_s` and `chunk_times_s` are offsets from the request's own send time.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson


@dataclass(frozen=True, slots=True)
class Migration:
    from_backend: str
    to_backend: str
    at_token: int | None
    reason: str
    at_s: float  # when the event arrived, from the request's send time


@dataclass(frozen=True, slots=True)
class RequestResult:
    seq: int
    id: str
    model: str
    arrival_s: float  # scheduled
    sent_s: float  # actual
    e2e_s: float  # until the stream ended (or failed)
    ttft_s: float | None  # first event carrying output text
    tpot_s: float | None  # (last - first text event) / (output_tokens - 1)
    chunk_times_s: tuple[float, ...]  # one per event carrying text (≥ 1 token each)
    prompt_tokens: int | None  # from the response's usage
    output_tokens: int | None  # from the response's usage
    max_tokens: int
    backend: str | None  # x-laneway-backend: where the request was routed first
    status: int | None  # HTTP status; None when no response arrived
    error: str | None = None
    migrations: tuple[Migration, ...] = ()
    slo_s: float | None = None  # the SLO sent with the request, if any
    source: str = ""
    quality: Mapping[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def final_backend(self) -> str | None:
        return self.migrations[-1].to_backend if self.migrations else self.backend

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> RequestResult:
        fields = {k: v for k, v in row.items() if k != "type"}
        fields["chunk_times_s"] = tuple(fields.get("chunk_times_s", ()))
        fields["migrations"] = tuple(Migration(**m) for m in fields.get("migrations", ()))
        return cls(**fields)


@dataclass(frozen=True, slots=True)
class RunFile:
    path: Path
    header: Mapping[str, Any]
    results: tuple[RequestResult, ...]

    @property
    def name(self) -> str:
        label = self.header.get("label")
        return str(label) if label else self.path.stem

    @property
    def policy(self) -> str:
        return str(self.header.get("policy") or "-")


class ResultsWriter:
    """Appends each result as it completes, so an interrupted run keeps what it got."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self.written = 0

    def header(self, fields: Mapping[str, Any]) -> None:
        self._line({"type": "run", **fields})

    def __call__(self, result: RequestResult) -> None:
        self._line({"type": "request", **asdict(result)})
        self.written += 1

    def _line(self, row: Mapping[str, Any]) -> None:
        self._stream.write(orjson.dumps(row) + b"\n")
        self._stream.flush()


@contextlib.contextmanager
def writing(path: Path) -> Iterator[ResultsWriter]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as stream:
        yield ResultsWriter(stream)


def read(path: Path) -> RunFile:
    header: dict[str, Any] = {}
    results = []
    with path.open("rb") as f:
        for line in f:
            if not line.strip():
                continue
            row = orjson.loads(line)
            if row.get("type") == "run":
                header = row
            elif row.get("type") == "request":
                results.append(RequestResult.from_row(row))
    if not header:
        raise ValueError(f"{path}: no run header; not a `python -m bench run` result file")
    return RunFile(path, header, tuple(results))


def write_json(path: Path, data: Any) -> None:
    """A benchmark's summary JSON (indented, one trailing newline), its folder made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def publish(path: Path, result: dict[str, Any], table: str) -> None:
    """Print a benchmark's table and whether it met its targets; write its JSON."""
    print(table)
    print("meets targets:", result["meets_targets"])
    write_json(path, result)
    print(f"\nwritten to {path}")
