"""The overhead harness in a tiny configuration, against in-process fakes directly.

Asserts the harness computes sane figures, not the proxy's timing targets.
"""

from __future__ import annotations

import os

import pytest

from bench.fakes.fake_vllm import FakeConfig, serve_fake
from bench.studies.overhead import Legs, Plan, measure, table, verdict
from predictors.home import REPO


async def test_harness_measures_direct_against_direct() -> None:
    plan = Plan(requests=20, tokens=10, concurrency=(1, 4), repeat=1, tpot_ms=5,
                idle_s=0.05, phase_timeout_s=30)
    async with serve_fake(FakeConfig(model="fast")) as fast, \
            serve_fake(FakeConfig(model="paced", tpot_s=0.005)) as paced:
        # The "target" is the fakes themselves; CPU is this process's (it serves them).
        legs = Legs(fast.url, paced.url, fast.url, paced.url, target_pid=os.getpid())
        result = await measure(legs, plan)
        served = paced.app.stats.finished
    for key in ("non_stream", "ttft"):
        assert 0 < result[key]["direct_p50_ms"] <= result[key]["direct_p99_ms"]
        assert 0 < result[key]["target_p50_ms"] <= result[key]["target_p99_ms"]
    assert set(result["streaming"]) == {"1", "4"}
    for streams, run in result["streaming"].items():
        assert run["tokens_relayed"] == int(streams) * plan.tokens
        assert run["target_failed_streams"] == run["direct_failed_streams"] == 0
        assert run["direct_tokens_per_s"] > 0 and 0.3 < run["ratio"] < 3
        assert run["target_cpu_us_per_token"] >= 0  # /proc counts 10 ms ticks: may be 0
        # The first token comes without a TPOT wait: at most tokens / (tokens - 1) x ideal.
        assert 0.2 < run["direct_vs_ideal"] <= plan.tokens / (plan.tokens - 1) * 1.02
    assert served == 2 * (1 + 4)  # direct and target leg at each concurrency
    assert result["floor_relay_cpu_us_per_token"] is None  # no floor relay given
    assert set(verdict(result)) == {"added_p50_ms", "added_p99_ms", "throughput_ratio_256"}
    assert "4 streams" in table(result)


def test_cpu_ab_runs_two_checkouts_in_turn(capsys: pytest.CaptureFixture[str]) -> None:
    """`bench.harness.cpu_ab` with this repository as both sides, tiny: every stream relayed
    by both proxies, a figure per round, and the difference."""
    from bench.harness.cpu_ab import main

    assert main([str(REPO), str(REPO), "--rounds", "2", "--streams", "4",
                 "--tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.count("µs/token; rounds ") == 2
    assert "lower in " in out and " of 2 rounds" in out


def test_cpu_ab_reports_a_round_with_no_cpu_tick_instead_of_dividing_by_it() -> None:
    from bench.harness.cpu_ab import difference

    assert difference([0.0, 0.0], [10.0, 0.0]) == \
        "B - A: mean +5.0 µs/token (A measured 0); lower in 0 of 2 rounds"
    assert difference([20.0, 20.0], [10.0, 20.0]) == \
        "B - A: mean -5.0 µs/token (-25.0%); lower in 1 of 2 rounds"
