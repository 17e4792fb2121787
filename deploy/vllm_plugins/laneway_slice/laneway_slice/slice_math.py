"""SLICE's math as pure functions: utility rate, period estimate, greedy task
selection (Alg. 2), the decode-mask matrix and its column schedule (Alg. 3), and
the utility adaptor (Alg. 4). No vLLM here; the readings of the paper's typos are
in docs/slice.md.

Units: TPOT and latencies in milliseconds, the period is 1000 ms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

PERIOD_MS = 1000.0

# l(n): the decode step latency (ms) at batch size n.
StepLatency = Callable[[int], float]


@dataclass(frozen=True, slots=True)
class Task:
    """One request as SLICE sees it."""

    task_id: str
    tpot_ms: float  # the TPOT it needs
    utility: float  # U, after the adaptor
    prefill_ms: float = 0.0  # prefill work it still owes, reserved in the period
    priority: int = 0  # vLLM's `priority`: lower first among equal utility rates
    arrival: float = 0.0  # then first come, first served


@dataclass(frozen=True, slots=True)
class Selection:
    selected: tuple[Task, ...]  # in the order Alg. 2 added them
    rejected: tuple[Task, ...]
    period_ms: float  # estimated period of `selected`, prefill reserve included


@dataclass(frozen=True, slots=True)
class DecodeMask:
    """Rows in descending token rate; `matrix[k][j]`: row k decodes in column j."""

    rows: tuple[Task, ...]
    matrix: tuple[tuple[bool, ...], ...]

    @property
    def ones_per_row(self) -> dict[str, int]:
        """Tokens per period each row is given."""
        return {row.task_id: sum(bits) for row, bits in zip(self.rows, self.matrix, strict=True)}

    @property
    def columns(self) -> tuple[frozenset[str], ...]:
        """Each column's batch (task ids): the period's decode steps in order."""
        width = len(self.matrix[0]) if self.matrix else 0
        return tuple(
            frozenset(row.task_id for row, bits in zip(self.rows, self.matrix, strict=True)
                      if bits[j])
            for j in range(width)
        )


def tokens_per_period(tpot_ms: float) -> int:
    """v = ceil(1 s / TPOT): ceil, not the released code's floor, or 120 ms would get
    8 tokens a second where it needs 8.33. The epsilon keeps 100 ms at exactly 10."""
    return max(1, math.ceil(PERIOD_MS / tpot_ms - 1e-9))


def utility_rate(task: Task) -> float:
    """Eq. 6: r = U * T_TPOT, the utility per token of one second's tokens."""
    return task.utility * task.tpot_ms / PERIOD_MS


def by_token_rate(tasks: Sequence[Task]) -> list[Task]:
    """Descending v (sortTasksBySLORateDescending); stable, so ties keep their order."""
    return sorted(tasks, key=lambda t: -tokens_per_period(t.tpot_ms))


def by_utility_rate(tasks: Sequence[Task]) -> list[Task]:
    """Alg. 2's pick order: highest r first, then `priority`, then arrival."""
    return sorted(tasks, key=lambda t: (-utility_rate(t), t.priority, t.arrival))


def column_batch_sizes(rates: Sequence[int]) -> list[int]:
    """How many rows have a one in each column, for rows of `rates` tokens per period
    laid out from column 0 (any order of `rates`)."""
    width = max(rates, default=0)
    return [sum(1 for v in rates if v > j) for j in range(width)]


def period_ms(rates: Sequence[int], latency: StepLatency) -> float:
    """Eq. 7 summed column by column: sum over the mask's columns of l(ones in it).
    Equal to v_b*l(b+1) + sum_{j<b} (v_j - v_{j+1})*l(j+1) for v sorted descending."""
    return sum(latency(n) for n in column_batch_sizes(rates))


def select_tasks(tasks: Sequence[Task], latency: StepLatency,
                 reserve_ms: float = 0.0, budget_ms: float = PERIOD_MS) -> Selection:
    """Alg. 2: add tasks by descending utility rate while the period (decode columns,
    each added task's prefill, `reserve_ms`) stays under `budget_ms`; stop at the
    first task that does not fit, as written (no skipping to smaller ones).

    The period is kept column by column: adding a row of v tokens adds one to the
    batch of columns 0..v-1, so each candidate costs O(v), not a full Eq. 7."""
    ordered = by_utility_rate(tasks)
    counts: list[int] = []  # ones per column of the mask so far
    estimate = reserve_ms
    for index, task in enumerate(ordered):
        v = tokens_per_period(task.tpot_ms)
        grown = counts + [0] * max(0, v - len(counts))
        delta = sum(latency(grown[j] + 1) - latency(grown[j]) for j in range(v))
        trial = estimate + delta + task.prefill_ms
        if trial >= budget_ms:  # Alg. 2 line 13
            return Selection(tuple(ordered[:index]), tuple(ordered[index:]), estimate)
        counts = [n + 1 if j < v else n for j, n in enumerate(grown)]
        estimate = trial
    return Selection(tuple(ordered), (), estimate)


def build_mask(tasks: Sequence[Task]) -> DecodeMask:
    """Alg. 3 lines 3-11: rows by descending rate, row k's first v_k columns set,
    v_0 (the fastest row's rate) columns."""
    rows = by_token_rate(tasks)
    rates = [tokens_per_period(t.tpot_ms) for t in rows]
    width = max(rates, default=0)
    matrix = tuple(tuple(j < v for j in range(width)) for v in rates)
    return DecodeMask(tuple(rows), matrix)


def adapt_utility(utility: float, *, selected: bool, waited_s: float,
                  aging_s: float, stickiness: float) -> float:
    """Alg. 4's UTILITYADAPTOR (the paper gives no formula; docs/slice.md).

    A selected task keeps a bonus `stickiness` (U*(1+s)), so an arrival of similar
    utility does not evict it and tasks do not swap every re-plan (thrash). A task
    left out ages linearly, U*(1 + waited/aging), so it outbids any fixed utility
    after a bounded wait (`starvation_bound_s`): no task starves forever."""
    if selected:
        return utility * (1.0 + stickiness)
    return utility * (1.0 + max(0.0, waited_s) / aging_s)


def starvation_bound_s(waiting: Task, top: Task, aging_s: float,
                       stickiness: float) -> float:
    """The wait after which `waiting` (base utility) outbids `top` (base utility,
    selected, so sticky) in utility rate, i.e. Alg. 2 picks it first."""
    ratio = utility_rate(top) * (1.0 + stickiness) / utility_rate(waiting)
    return max(0.0, (ratio - 1.0) * aging_s)
