"""SLO classes and the per-request metadata that picks one.

A request names its class and overrides in the body's `vllm_xargs` (vLLM hands them
to the engine as `sampling_params.extra_args`, flat str/int/float values):
`laneway_slo_class`, `laneway_tpot_ms`, `laneway_deadline_ms`, `laneway_utility`.
The classes are the paper's workloads (Sec. VI-A): real-time 20 tok/s with a 1.5 s
deadline, voice 8 tok/s, text 10 tok/s; real-time utility 50x the others' (the
paper: 10-100x).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

KEY_CLASS = "laneway_slo_class"
KEY_TPOT_MS = "laneway_tpot_ms"
KEY_DEADLINE_MS = "laneway_deadline_ms"
KEY_UTILITY = "laneway_utility"


@dataclass(frozen=True, slots=True)
class SloClass:
    name: str
    tpot_ms: float
    utility: float
    deadline_ms: float | None = None  # end to end, real-time tasks


CLASSES: Mapping[str, SloClass] = {
    "realtime": SloClass("realtime", tpot_ms=50.0, utility=50.0, deadline_ms=1500.0),
    "voice": SloClass("voice", tpot_ms=125.0, utility=1.0),
    "text": SloClass("text", tpot_ms=100.0, utility=1.0),
}
DEFAULT_CLASS = "text"  # requests without laneway xargs


def _positive(value: object) -> float | None:
    """A finite positive number, else None: a bad override is ignored, never raised
    inside the engine (an exception in schedule() kills the engine core)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) and number > 0 else None


def request_class(extra_args: Mapping[str, object] | None, max_tokens: int | None,
                  default: str = DEFAULT_CLASS) -> SloClass:
    """The effective class of one request: its named class (else `default`), its
    overrides, and an explicit deadline turned into a TPOT the way the paper turns a
    deadline into a rate: deadline / max_tokens, if that is stricter."""
    args = extra_args or {}
    named = args.get(KEY_CLASS)
    base = CLASSES.get(named if isinstance(named, str) else "", CLASSES[default])
    tpot = _positive(args.get(KEY_TPOT_MS)) or base.tpot_ms
    utility = _positive(args.get(KEY_UTILITY)) or base.utility
    deadline = _positive(args.get(KEY_DEADLINE_MS))
    if deadline is not None and max_tokens:
        tpot = min(tpot, deadline / max_tokens)
    return replace(base, tpot_ms=tpot, utility=utility,
                   deadline_ms=deadline if deadline is not None else base.deadline_ms)
