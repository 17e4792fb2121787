"""The plugin's settings, read once from the engine's environment.

vLLM builds the scheduler itself (`--scheduler-cls` takes a class, no arguments),
so, like the ELDR plugin's LANEWAY_ELDR_PORT, configuration comes from `LANEWAY_SLICE_*`
variables; unset means the default, a malformed value fails the engine's start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from laneway_slice.latency_profile import StepLatencyProfile
from laneway_slice.planner import PlannerSettings
from laneway_slice.slo_classes import CLASSES, DEFAULT_CLASS

PREFIX = "LANEWAY_SLICE_"


@dataclass(frozen=True, slots=True)
class SliceSettings:
    planner: PlannerSettings
    prior_base_ms: float = 20.0  # l(n) before any step is seen: base + per_seq * n
    prior_per_seq_ms: float = 2.0
    default_class: str = DEFAULT_CLASS
    stats_path: Path | None = None  # JSON counters, rewritten every step

    def profile(self) -> StepLatencyProfile:
        return StepLatencyProfile(self.prior_base_ms, self.prior_per_seq_ms)


def from_env(env: Mapping[str, str]) -> SliceSettings:
    def number(name: str, default: float) -> float:
        raw = env.get(PREFIX + name)
        return default if raw is None or raw == "" else float(raw)

    defaults = PlannerSettings()
    planner = PlannerSettings(
        pace=env.get(PREFIX + "PACE", "1").lower() not in ("0", "false", "no", "off"),
        aging_s=number("AGING_S", defaults.aging_s),
        stickiness=number("STICKINESS", defaults.stickiness),
        reserve_ms=number("RESERVE_MS", defaults.reserve_ms),
        max_sleep_s=min(0.010, number("MAX_SLEEP_MS", 10.0) / 1000.0),
    )
    default_class = env.get(PREFIX + "DEFAULT_CLASS", DEFAULT_CLASS)
    if default_class not in CLASSES:
        raise ValueError(f"{PREFIX}DEFAULT_CLASS={default_class!r}: not one of "
                         f"{sorted(CLASSES)}")
    stats = env.get(PREFIX + "STATS")
    return SliceSettings(planner, number("PRIOR_BASE_MS", 20.0),
                         number("PRIOR_PER_SEQ_MS", 2.0), default_class,
                         Path(stats) if stats else None)
