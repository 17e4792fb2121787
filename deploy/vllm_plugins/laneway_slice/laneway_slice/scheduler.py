"""SLICE inside vLLM 0.32's V1 engine core: `--scheduler-cls
laneway_slice.scheduler.SliceScheduler` (CPU; async scheduling is off there) or
`...AsyncSliceScheduler` (GPU builds with async scheduling; untested here).

Before each `Scheduler.schedule()` the planner (planner.py) says which requests
decode this step (the mask column), which are selected; this module applies it with
vLLM's own knobs, nothing patched:

* mask: `request.next_decode_eligible_step = max(old, current_step + 2)` skips one
  decode and keeps the KV (scheduler.py:592 increments `current_step` before the
  running loop's check at scheduler.py:680); never for a request mid prefill;
* admission: selected waiting requests go to the front of the FCFS queue and
  `max_num_active_reqs` is capped for the step (the check at scheduler.py:922-923);
* `running` is kept in the planner's rank, so vLLM's KV preemption, which pops the
  last running request (scheduler.py:802, 834), evicts the least valuable;
* no busy spin: when no column is due and there is no prefill to run, schedule()
  sleeps until the next due token, at most 10 ms (the engine loop itself only
  sleeps 1 ms after an empty step, core.py:1616-1617).

l(n) is learnt from the time between a schedule() and its update_from_output()
(core.py:667-682 runs them around the model step).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from laneway_slice.planner import SlicePlanner, StepPlan, TaskInput
from laneway_slice.settings import SliceSettings, from_env
from laneway_slice.slo_classes import request_class

SUPPORTED_VLLM = "0.32."
if not vllm.__version__.startswith(SUPPORTED_VLLM):
    raise ImportError(
        f"laneway_slice needs vLLM {SUPPORTED_VLLM}x, found {vllm.__version__}: it "
        "subclasses the V1 Scheduler, which vLLM does not keep stable; re-check the "
        "attributes in REQUIRED_* (laneway_slice/scheduler.py) before raising the pin")

# What this module reads or writes on vLLM's objects (checked, not assumed).
REQUIRED_SCHEDULER = ("running", "waiting", "requests", "current_step",
                      "max_num_active_reqs", "max_num_running_reqs")
REQUIRED_REQUEST = ("request_id", "next_decode_eligible_step", "num_computed_tokens",
                    "num_tokens", "sampling_params", "priority", "arrival_time",
                    "is_finished")
REQUIRED_QUEUE = ("remove_requests", "prepend_requests")


def _missing(obj: object, names: tuple[str, ...]) -> list[str]:
    return [name for name in names if not hasattr(obj, name)]


@dataclass(slots=True)
class SliceStats:
    """Counters the plugin writes to `LANEWAY_SLICE_STATS` (tests, debugging)."""

    steps: int = 0
    empty_steps: int = 0  # requests present, nothing scheduled
    spin_steps: int = 0  # empty steps that did not sleep first: the busy spin
    masked_decodes: int = 0
    sleeps: int = 0
    sleep_s: float = 0.0
    replans: int = 0
    selected: int = 0
    unfinished: int = 0
    period_columns: int = 0


class SliceScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        missing = _missing(self, REQUIRED_SCHEDULER) or _missing(self.waiting, REQUIRED_QUEUE)
        if missing:
            raise RuntimeError(f"laneway_slice: vLLM {vllm.__version__}'s Scheduler lacks "
                               f"{missing}; this plugin supports {SUPPORTED_VLLM}x only")
        self._slice_settings: SliceSettings = from_env(os.environ)
        self._slice = SlicePlanner(self._slice_settings.planner,
                                   self._slice_settings.profile())
        self._slice_active_cap: int = self.max_num_active_reqs
        self._slice_classes: dict[str, tuple[float, float]] = {}  # id -> (tpot, U)
        self._slice_checked_request = False
        self._slice_step_start: tuple[float, int, int] | None = None
        self._slice_stats = SliceStats()

    # -- the step ------------------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        tasks = self._slice_tasks()
        plan = self._slice.step(tasks, time.monotonic())
        slept = plan.wait_s > 0 and not self._slice_prefill_pending(plan)
        if slept:
            pause = min(plan.wait_s, self._slice_settings.planner.max_sleep_s)
            time.sleep(pause)
            self._slice_stats.sleeps += 1
            self._slice_stats.sleep_s += pause
            plan = self._slice.step(tasks, time.monotonic())
        self._slice_apply(plan)
        started = time.monotonic()
        output = super().schedule(throttle_prefills)
        self._slice_after(output, started, len(tasks), slept)
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> Any:
        if self._slice_step_start is not None:
            started, decodes, prefill_tokens = self._slice_step_start
            step_ms = (time.monotonic() - started) * 1000.0
            if prefill_tokens:
                self._slice.profile.observe_prefill(decodes, prefill_tokens, step_ms)
            else:
                self._slice.profile.observe_decode(decodes, step_ms)
            self._slice_step_start = None
        return super().update_from_output(scheduler_output, model_runner_output)

    # -- reading requests ----------------------------------------------------------

    def _slice_tasks(self) -> list[TaskInput]:
        tasks: list[TaskInput] = []
        for request in self.requests.values():
            if request.is_finished():
                continue
            tpot_ms, utility = self._slice_class(request)
            tasks.append(TaskInput(request.request_id, tpot_ms, utility,
                                   _prefill_tokens(request), request.priority,
                                   request.arrival_time))
        live = {t.task_id for t in tasks}
        for gone in [rid for rid in self._slice_classes if rid not in live]:
            del self._slice_classes[gone]
        return tasks

    def _slice_class(self, request: Request) -> tuple[float, float]:
        known = self._slice_classes.get(request.request_id)
        if known is not None:
            return known
        if not self._slice_checked_request:
            missing = _missing(request, REQUIRED_REQUEST)
            if missing:
                raise RuntimeError(f"laneway_slice: vLLM {vllm.__version__}'s Request "
                                   f"lacks {missing}; supported: {SUPPORTED_VLLM}x")
            self._slice_checked_request = True
        params = request.sampling_params
        extra = params.extra_args if params is not None else None
        max_tokens = params.max_tokens if params is not None else None
        slo = request_class(extra, max_tokens, self._slice_settings.default_class)
        self._slice_classes[request.request_id] = (slo.tpot_ms, slo.utility)
        return slo.tpot_ms, slo.utility

    def _slice_prefill_pending(self, plan: StepPlan) -> bool:
        """Work that runs this step whatever the mask: a prefill under way, or a
        selected request waiting for admission."""
        return (any(_prefill_tokens(r) > 0 for r in self.running)
                or any(r.request_id in plan.selected_ids for r in self.waiting))

    # -- applying the plan -----------------------------------------------------------

    def _slice_apply(self, plan: StepPlan) -> None:
        last = len(plan.rank)
        self.running.sort(key=lambda r: plan.rank.get(r.request_id, last))
        for request in self.running:
            if request.request_id in plan.decode_ids or _prefill_tokens(request) > 0:
                continue  # never mask a request mid (chunked) prefill
            request.next_decode_eligible_step = max(
                request.next_decode_eligible_step, self.current_step + 2)
            self._slice_stats.masked_decodes += 1
        admit = sorted((r for r in self.waiting if r.request_id in plan.selected_ids),
                       key=lambda r: plan.rank.get(r.request_id, last))
        if admit:
            self.waiting.remove_requests(admit)
            self.waiting.prepend_requests(reversed(admit))  # extendleft reverses
        self.max_num_active_reqs = min(self._slice_active_cap,
                                       len(self.running) + len(admit))

    def _slice_after(self, output: SchedulerOutput, started: float, unfinished: int,
                     slept: bool) -> None:
        counts = output.num_scheduled_tokens
        decodes = sum(1 for n in counts.values() if n == 1)
        prefill_tokens = sum(n for n in counts.values() if n > 1)
        self._slice_step_start = (started, decodes, prefill_tokens) if counts else None
        stats = self._slice_stats
        stats.steps += 1
        if unfinished and output.total_num_scheduled_tokens == 0:
            stats.empty_steps += 1
            stats.spin_steps += not slept
        stats.replans = self._slice.replans
        stats.unfinished = unfinished
        stats.selected = len(self._slice.mask.rows)
        stats.period_columns = self._slice.period_columns
        self._slice_write_stats()

    def _slice_write_stats(self) -> None:
        """Every step (counters only change in schedule(), so the file is never
        stale); only when LANEWAY_SLICE_STATS is set (tests, debugging)."""
        path = self._slice_settings.stats_path
        if path is None:
            return
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(json.dumps(asdict(self._slice_stats)))
        partial.replace(path)  # readers never see half a file


class AsyncSliceScheduler(SliceScheduler, AsyncScheduler):
    """For builds with async scheduling (GPU). AsyncScheduler sets
    `next_decode_eligible_step` only after a request was scheduled
    (async_scheduler.py:52-57) and SliceScheduler masks with max(), so both hold.
    l(n) is then measured over overlapped steps (an over-estimate)."""


def _prefill_tokens(request: Request) -> int:
    """Prompt (or after preemption, recompute) tokens still to run: a decode step has
    exactly one token to compute."""
    left: int = request.num_tokens - request.num_computed_tokens
    return left if left > 1 else 0
