"""SLICE online (Alg. 4) as a state machine the scheduler asks once per engine step.

`SlicePlanner.step(tasks, now)` re-plans (adaptor, Alg. 2, Alg. 3's mask) when the
set of requests changed (arrival, departure, abort) or the mask wrapped around (so
the adaptor's aging takes effect), then answers which requests decode this step:
the next column's batch. No vLLM here; scheduler.py applies the answer.

Pacing (`pace`, default on; docs/slice.md): the paper scans columns back to back;
paced, column j of a period is due `j * slot` after the period started, with
`slot = 1 s / columns`, so every task gets v tokens per second, not more, and the
idle rest of the second is headroom for prefill. A period estimated at 1 s or more
(overload, or a best-effort task) is not paced. The
period's phase is kept across re-plans (the cursor is rescaled to the new width)
so an arrival mid-period does not restart it and hand everyone extra tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from laneway_slice.latency_profile import StepLatencyProfile
from laneway_slice.slice_math import (
    PERIOD_MS,
    DecodeMask,
    Task,
    adapt_utility,
    build_mask,
    by_utility_rate,
    select_tasks,
)


@dataclass(frozen=True, slots=True)
class PlannerSettings:
    pace: bool = True
    aging_s: float = 1.0  # adaptor: a left-out task's utility doubles every aging_s
    stickiness: float = 0.5  # adaptor: a selected task's utility bonus
    reserve_ms: float = 50.0  # kept free in every period for arrivals' prefill
    max_sleep_s: float = 0.010  # the longest schedule() sleeps when nothing is due


@dataclass(frozen=True, slots=True)
class TaskInput:
    """One unfinished request, as the scheduler reads it each step."""

    task_id: str
    tpot_ms: float
    utility: float  # base, before the adaptor
    prefill_tokens: int  # prompt (or recompute) tokens still to run
    priority: int = 0
    arrival: float = 0.0


@dataclass(frozen=True, slots=True)
class StepPlan:
    decode_ids: frozenset[str]  # may decode this step; every other decode is masked
    selected_ids: frozenset[str]  # admitted (waiting) or kept decoding (running)
    rank: Mapping[str, int]  # 0 = most valuable: running/waiting order, eviction last
    wait_s: float = 0.0  # > 0: no column is due for this long (paced)


@dataclass(slots=True)
class SlicePlanner:
    settings: PlannerSettings = field(default_factory=PlannerSettings)
    profile: StepLatencyProfile = field(default_factory=StepLatencyProfile)
    replans: int = 0
    _known: frozenset[str] = frozenset()
    _last_selected: dict[str, float] = field(default_factory=dict)
    _mask: DecodeMask = field(default_factory=lambda: build_mask([]))
    _columns: tuple[frozenset[str], ...] = ()
    _selected: frozenset[str] = frozenset()
    _rank: dict[str, int] = field(default_factory=dict)
    _cursor: int = 0
    _wrapped: bool = False
    _next_due: float | None = None
    _last_column_at: float | None = None
    _slot_s: float = 0.0

    @property
    def mask(self) -> DecodeMask:
        return self._mask

    @property
    def period_columns(self) -> int:
        return len(self._columns)

    def step(self, tasks: Sequence[TaskInput], now: float) -> StepPlan:
        ids = frozenset(t.task_id for t in tasks)
        if ids != self._known or self._wrapped:
            self._replan(tasks, now)
        if not self._columns:
            return StepPlan(frozenset(), self._selected, self._rank)
        due = self._next_due if self._next_due is not None else now
        if self.settings.pace and now < due:
            return StepPlan(frozenset(), self._selected, self._rank, wait_s=due - now)
        column = self._columns[self._cursor]
        self._cursor = (self._cursor + 1) % len(self._columns)
        self._wrapped = self._cursor == 0
        # At most one slot of catch-up after a stall (a long prefill): no burst.
        self._next_due = max(due + self._slot_s, now - self._slot_s)
        self._last_column_at = now
        return StepPlan(column, self._selected, self._rank)

    def _replan(self, tasks: Sequence[TaskInput], now: float) -> None:
        self.replans += 1
        self._wrapped = False
        current = {t.task_id for t in tasks}
        for gone in set(self._last_selected) - current:
            del self._last_selected[gone]
        for new in current:  # a new task waits from its arrival here
            self._last_selected.setdefault(new, now)
        adapted = [self._adapt(t, now) for t in tasks]
        selection = select_tasks(adapted, self.profile, self.settings.reserve_ms)
        chosen = list(selection.selected)
        estimate = selection.period_ms
        if not chosen and adapted:
            # Alg. 2 selects nothing when even the best task alone cannot meet its
            # rate: serve it best effort (as fast as it goes) instead of hanging.
            chosen = by_utility_rate(adapted)[:1]
            estimate = select_tasks(chosen, self.profile, budget_ms=float("inf")).period_ms
        for task in chosen:
            self._last_selected[task.task_id] = now
        self._install(build_mask(chosen), estimate, now)
        self._selected = frozenset(t.task_id for t in chosen)
        rest = [t for t in by_utility_rate(adapted) if t.task_id not in self._selected]
        order = [*by_utility_rate(chosen), *rest]
        self._rank = {t.task_id: i for i, t in enumerate(order)}
        self._known = frozenset(current)

    def _adapt(self, task: TaskInput, now: float) -> Task:
        selected = task.task_id in self._selected
        utility = adapt_utility(task.utility, selected=selected,
                                waited_s=now - self._last_selected[task.task_id],
                                aging_s=self.settings.aging_s,
                                stickiness=self.settings.stickiness)
        return Task(task.task_id, task.tpot_ms, utility,
                    self.profile.prefill_ms(task.prefill_tokens), task.priority,
                    task.arrival)

    def _install(self, mask: DecodeMask, estimate_ms: float, now: float) -> None:
        """The new mask, keeping the period's phase: the cursor moves to the same
        fraction of the (possibly wider or narrower) new period."""
        old_width, columns = len(self._columns), mask.columns
        self._cursor = self._cursor * len(columns) // old_width if old_width else 0
        self._mask, self._columns = mask, columns
        if not columns:
            self._cursor, self._next_due = 0, None
            return
        # Paced only with slack: a period estimated at a second or more (overload,
        # a best-effort task) runs its columns back to back, as in the paper.
        paced = self.settings.pace and estimate_ms < PERIOD_MS
        self._slot_s = PERIOD_MS / len(columns) / 1000.0 if paced else 0.0
        # The next column is one new slot after the last one ran (not the old plan's
        # due time, whose slot may have been wider).
        last = self._last_column_at
        self._next_due = now if last is None else min(now, last) + self._slot_s

