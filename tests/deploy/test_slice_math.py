"""SLICE's math and planner (deploy/vllm_plugins/laneway_slice), without vLLM.

The static test is the paper's Sec. VI-B / Table II: 9 tasks, 3 of class A (TPOT
100 ms), 4 of B (120 ms), 2 of C (250 ms). The paper gives l(n) only as a plot
(Fig. 1), so the table below is pinned to the numbers its text does give:
* l(9) = 128.59 ms: Orca's measured TPOT with all 9 tasks in every step (Table II);
* l(n <= 8) linear and under 100 ms ("when the batch size exceeds 8 tasks, the
  decoding latency surpasses the 100ms threshold", Sec. VI-D), with the slope chosen
  so SLICE's period is the 940 ms that Table II's class-A TPOT implies (94.03 ms
  per step x 10 steps per period, class A being in every column).
"""

from __future__ import annotations

import math
import random

import pytest
from laneway_slice.latency_profile import StepLatencyProfile
from laneway_slice.planner import PlannerSettings, SlicePlanner, TaskInput
from laneway_slice.slice_math import (
    Task,
    adapt_utility,
    build_mask,
    period_ms,
    select_tasks,
    starvation_bound_s,
    tokens_per_period,
    utility_rate,
)
from laneway_slice.slo_classes import request_class

TABLE_II_L9_MS = 128.59


def paper_latency(batch: int) -> float:
    if batch <= 0:
        return 0.0
    return TABLE_II_L9_MS if batch >= 9 else 50.0 + 3.32 * batch


def static_tasks() -> list[Task]:
    classes = [("A", 100.0, 3), ("B", 120.0, 4), ("C", 250.0, 2)]
    return [Task(f"{name}{i}", tpot, utility=1.0, arrival=float(n))
            for n, (name, tpot, count) in enumerate(classes) for i in range(count)]


def eq7_literal(rates_descending: list[int], latency: object) -> float:
    """Eq. 7 as printed: v_b l(b+1) + sum_{j=0}^{b-1} (v_j - v_{j+1}) l(j+1)."""
    assert callable(latency)
    v, b = rates_descending, len(rates_descending) - 1
    return float(v[b] * latency(b + 1)
                 + sum((v[j] - v[j + 1]) * latency(j + 1) for j in range(b)))


def test_static_test_selects_all_nine_under_a_second_where_fcfs_meets_two() -> None:
    tasks = static_tasks()
    selection = select_tasks(tasks, paper_latency)
    assert {t.task_id for t in selection.selected} == {t.task_id for t in tasks}
    assert selection.period_ms < 1000.0
    assert selection.period_ms == pytest.approx(940.3, abs=1.0)  # Table II: 10 x 94.03

    mask = build_mask(selection.selected)
    want = {"A": 10, "B": 9, "C": 4}  # ceil(1000/100), ceil(1000/120), ceil(1000/250)
    assert mask.ones_per_row == {t.task_id: want[t.task_id[0]] for t in tasks}
    # each class's rate over the estimated period meets its TPOT
    for task in tasks:
        assert want[task.task_id[0]] / (selection.period_ms / 1000) >= 1000 / task.tpot_ms

    # FCFS, unlimited batch: all 9 decode in every step at l(9), 7.78 tok/s each
    fcfs_rate = 1000.0 / paper_latency(len(tasks))
    met = [t.task_id for t in tasks if fcfs_rate >= 1000.0 / t.tpot_ms]
    assert sorted(met) == ["C0", "C1"]  # 2/9, Table II's 22 %


def test_ceil_not_floor_gives_each_class_its_rate() -> None:
    assert [tokens_per_period(t) for t in (100.0, 120.0, 250.0, 50.0, 125.0)] == \
        [10, 9, 4, 20, 8]
    assert math.floor(1000 / 120) / 1.0 < 1000 / 120  # floor would miss 8.33 tok/s


def test_period_is_eq7_summed_over_columns() -> None:
    rng = random.Random(7)
    for _ in range(50):
        rates = sorted((rng.randint(1, 20) for _ in range(rng.randint(1, 9))), reverse=True)
        assert period_ms(rates, paper_latency) == pytest.approx(
            eq7_literal(rates, paper_latency))


def test_greedy_stops_at_the_first_task_that_does_not_fit() -> None:
    def flat(batch: int) -> float:
        return 100.0 * (batch > 0)

    first = Task("fits", tpot_ms=500.0, utility=10.0)  # 2 tokens: 200 ms, r = 5
    blocker = Task("too-fast", tpot_ms=50.0, utility=50.0)  # 20 tokens: 2 s, r = 2.5
    small = Task("would-fit", tpot_ms=1000.0, utility=1.0)  # 1 token, r = 1
    selection = select_tasks([small, blocker, first], flat)
    assert [t.task_id for t in selection.selected] == ["fits"]
    assert [t.task_id for t in selection.rejected] == ["too-fast", "would-fit"]
    # the small one alone fits: only greediness leaves it out
    assert select_tasks([first, small], flat).selected == (first, small)


def test_utility_rate_orders_real_time_first() -> None:
    realtime = request_class({"laneway_slo_class": "realtime"}, max_tokens=30)
    text = request_class(None, max_tokens=30)
    rt = Task("rt", realtime.tpot_ms, realtime.utility)
    nrt = Task("text", text.tpot_ms, text.utility)
    assert utility_rate(rt) == pytest.approx(50.0 * 0.05)
    def fast(batch: int) -> float:
        return 10.0 + 5.0 * batch

    assert [t.task_id for t in select_tasks([nrt, rt], fast).selected] == ["rt", "text"]
    # at the paper's l(1) = 53 ms a 20 tok/s task alone takes 1.07 s a period
    assert select_tasks([nrt, rt], paper_latency).selected == ()


def test_mask_columns_cover_each_row_exactly_its_rate() -> None:
    rng = random.Random(3)
    for _ in range(30):
        tasks = [Task(f"t{i}", rng.choice([40.0, 50.0, 100.0, 120.0, 125.0, 250.0, 700.0]),
                      1.0) for i in range(rng.randint(1, 12))]
        mask = build_mask(tasks)
        columns = mask.columns
        assert len(columns) == max(tokens_per_period(t.tpot_ms) for t in tasks)
        for task in tasks:
            assert sum(task.task_id in c for c in columns) == tokens_per_period(task.tpot_ms)
        rates = [tokens_per_period(t.tpot_ms) for t in mask.rows]
        assert rates == sorted(rates, reverse=True)
        assert all(columns)  # the fastest row is in every column: no empty step


def test_fig4_example_columns() -> None:
    tasks = [Task(f"task{i}", 1000.0 / v, 1.0) for i, v in enumerate((6, 4, 2, 1))]
    columns = build_mask(tasks).columns
    assert [sorted(c) for c in columns] == [
        ["task0", "task1", "task2", "task3"], ["task0", "task1", "task2"],
        ["task0", "task1"], ["task0", "task1"], ["task0"], ["task0"]]


def one_fits(batch: int) -> float:
    return 40.0 * batch  # one 20 tok/s task: 800 ms; two: over a second


def rounds_until_selected(aging_s: float, rounds: int) -> int | None:
    """Re-plan once a second with a real-time task present throughout and one
    text task; the round at which the text task is first selected."""
    rt = ("rt", 50.0, 100.0)
    text = ("text", 100.0, 1.0)
    selected = {"rt"}
    last_selected = {"rt": 0.0, "text": 0.0}
    for now in range(1, rounds + 1):
        tasks = [Task(tid, tpot, adapt_utility(u, selected=tid in selected,
                                               waited_s=now - last_selected[tid],
                                               aging_s=aging_s, stickiness=0.5))
                 for tid, tpot, u in (rt, text)]
        selected = {t.task_id for t in select_tasks(tasks, one_fits).selected}
        for tid in selected:
            last_selected[tid] = float(now)
        if "text" in selected:
            return now
    return None


def test_the_adaptor_does_not_starve_a_non_real_time_task_forever() -> None:
    bound = starvation_bound_s(Task("text", 100.0, 1.0), Task("rt", 50.0, 100.0),
                               aging_s=1.0, stickiness=0.5)
    assert bound == pytest.approx(74.0)
    got = rounds_until_selected(aging_s=1.0, rounds=200)
    assert got is not None and got <= bound + 1
    assert rounds_until_selected(aging_s=math.inf, rounds=200) is None  # no aging: starves


def test_stickiness_keeps_a_running_task_from_an_equal_arrival() -> None:
    planner = SlicePlanner(PlannerSettings(pace=False, reserve_ms=0.0),
                           StepLatencyProfile(base_ms=0.0, per_seq_ms=60.0))
    first = TaskInput("first", 100.0, 1.0, prefill_tokens=0, arrival=1.0)
    # an earlier arrival time: without stickiness the tie would go to it
    second = TaskInput("second", 100.0, 1.0, prefill_tokens=0, arrival=0.5)
    assert planner.step([first], 0.0).selected_ids == {"first"}
    # only one fits (10 x 60 ms alone, 10 x 120 ms together); equal utility and
    # rate, yet the arrival does not evict the running task
    assert planner.step([first, second], 0.1).selected_ids == {"first"}
    assert planner.step([first, second], 0.1).rank["first"] == 0


def test_paced_planner_gives_rates_per_second_and_waits_between_columns() -> None:
    planner = SlicePlanner(PlannerSettings(pace=True, reserve_ms=0.0),
                           StepLatencyProfile(base_ms=5.0, per_seq_ms=1.0))
    fast = TaskInput("fast", 100.0, 1.0, prefill_tokens=0)  # 10 tokens a second
    slow = TaskInput("slow", 200.0, 1.0, prefill_tokens=0)  # 5
    decoded = {"fast": 0, "slow": 0}
    now, waits = 0.0, 0
    while now < 3.0:  # an engine whose every step takes 5 ms
        plan = planner.step([fast, slow], now)
        if plan.wait_s > 0:
            waits += 1
            assert plan.decode_ids == frozenset()
            now += min(plan.wait_s, 0.010)
            continue
        for task_id in plan.decode_ids:
            decoded[task_id] += 1
        now += 0.005
    assert decoded == {"fast": 30, "slow": 15}
    assert waits > 0


def test_unsatisfiable_task_is_served_best_effort() -> None:
    planner = SlicePlanner(PlannerSettings(pace=True, reserve_ms=0.0),
                           StepLatencyProfile(base_ms=10.0, per_seq_ms=0.0))
    greedy = TaskInput("greedy", 1.0, 1.0, prefill_tokens=0)  # 1000 tok/s: 10 s period
    for step in range(20):  # never paced: every step decodes it
        plan = planner.step([greedy], step * 0.001)
        assert plan.selected_ids == {"greedy"} and plan.decode_ids == {"greedy"}
        assert plan.wait_s == 0.0
    assert select_tasks([Task("greedy", 1.0, 1.0)], planner.profile).selected == ()


def test_request_class_reads_xargs_and_ignores_bad_values() -> None:
    assert request_class(None, 10).name == "text"
    voice = request_class({"laneway_slo_class": "voice", "laneway_utility": "3"}, 10)
    assert (voice.tpot_ms, voice.utility) == (125.0, 3.0)
    strict = request_class({"laneway_tpot_ms": 80, "laneway_deadline_ms": 1000}, 20)
    assert strict.tpot_ms == 50.0  # 1000 ms / 20 tokens is stricter than 80 ms
    bad = request_class({"laneway_tpot_ms": "fast", "laneway_utility": -1}, 10)
    assert (bad.tpot_ms, bad.utility) == (100.0, 1.0)


def test_unpaced_planner_scans_columns_back_to_back() -> None:
    planner = SlicePlanner(PlannerSettings(pace=False, reserve_ms=0.0),
                           StepLatencyProfile(base_ms=5.0, per_seq_ms=1.0))
    tasks = [TaskInput("fast", 100.0, 1.0, 0), TaskInput("slow", 200.0, 1.0, 0)]
    decoded = {"fast": 0, "slow": 0}
    for step in range(30):
        plan = planner.step(tasks, step * 0.005)
        assert plan.wait_s == 0.0
        for task_id in plan.decode_ids:
            decoded[task_id] += 1
    assert decoded == {"fast": 30, "slow": 15}  # three 10-column periods in 0.15 s


def test_an_arrival_mid_period_does_not_restart_it() -> None:
    """Alg. 4 restarts the offline scan on every event, which gives the low-rate rows
    (front-loaded in the mask) their tokens again each time; here the period goes on."""
    planner = SlicePlanner(PlannerSettings(pace=False, reserve_ms=0.0),
                           StepLatencyProfile(base_ms=5.0, per_seq_ms=1.0))
    fast, slow = TaskInput("fast", 100.0, 1.0, 0), TaskInput("slow", 500.0, 1.0, 0)
    slow_tokens = 0
    for step in range(10):  # one 10-column period; a third task arrives at column 5
        tasks = [fast, slow] + ([TaskInput("late", 500.0, 1.0, 0)] if step >= 5 else [])
        slow_tokens += "slow" in planner.step(tasks, step * 0.005).decode_ids
    assert slow_tokens == 2  # its v, not 2 more from a restart at column 0
