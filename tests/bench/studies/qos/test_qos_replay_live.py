"""bench.studies.qos.replay_live: a live run's decisions replayed in the simulator, compared
request by request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.studies.qos.live_client import schedule
from bench.studies.qos.replay_live import (
    action,
    capped_pool,
    compare,
    read_records,
    replay,
    run_name,
)
from tests.bench.studies.qos.qos_helpers import pool, specs

RATE, SEED = 5.0, 3


def records(actions: list[int], lpt_s: list[float | None] | None = None
            ) -> list[dict[str, Any]]:
    """Live records of the live client's arrivals (seed SEED) sent as `actions`."""
    texts = {p.id: "" for p in pool()}
    out = []
    for request, chosen in zip(schedule(pool(), texts, RATE, len(actions), SEED), actions,
                               strict=True):
        prompt = request.prompt
        out.append({"seq": request.seq, "prompt_id": prompt.id, "expert": chosen - 1,
                    "dropped": chosen == 0, "error": None, "needed": 10,
                    "lpt_s": None if lpt_s is None else lpt_s[request.seq],
                    "score": prompt.scores[max(0, chosen - 1)],
                    "qos": 0.0 if chosen == 0 else prompt.scores[chosen - 1]})
    return out


def test_the_live_actions_are_replayed_on_the_same_arrivals() -> None:
    live = records([1, 2, 0, 1, 2, 2])
    simulated = replay(specs(), pool(), RATE, 1.0, SEED, None, 1.0, live)
    assert [s.prompt.id for s in simulated] == [r["prompt_id"] for r in live]
    assert [s.expert for s in simulated] == [r["expert"] for r in live]
    assert simulated[2].qos == 0.0 and simulated[2].latency_per_token is None


def test_another_seed_is_refused_not_compared() -> None:
    live = records([1, 2, 1, 2, 1, 2, 1, 2])
    with pytest.raises(SystemExit, match="drew prompt"):
        replay(specs(), pool(), RATE, 1.0, SEED + 1, None, 1.0, live)


def test_a_request_that_failed_before_a_backend_is_replayed_as_a_drop() -> None:
    failed = {"dropped": False, "expert": -1}
    assert action(failed) == 0
    assert action({"dropped": True, "expert": -1}) == 0
    assert action({"dropped": False, "expert": 2}) == 3


def test_live_against_simulated_per_expert() -> None:
    actions = [1, 2, 0, 1, 2, 2]
    simulated = replay(specs(), pool(), RATE, 1.0, SEED, None, 1.0, records(actions))
    # live twice as slow as simulated on expert 0, as fast on expert 1
    lpt = [None if s.latency_per_token is None else
           s.latency_per_token * (2.0 if s.expert == 0 else 1.0) for s in simulated]
    cell = compare(records(actions, lpt), simulated, ["slow", "fast"])
    assert cell["experts"]["slow"]["requests"] == 2
    assert cell["experts"]["slow"]["median_ratio_live_to_sim"] == pytest.approx(2.0)
    assert cell["experts"]["fast"]["median_ratio_live_to_sim"] == pytest.approx(1.0)
    assert cell["experts"]["slow"]["live_lpt_ms"]["p50"] == pytest.approx(
        2 * cell["experts"]["slow"]["sim_lpt_ms"]["p50"])
    assert cell["live_avg_qos"] == pytest.approx(cell["sim_avg_qos"])  # generous L


def test_a_slower_lone_engine_shows_as_a_ratio_below_one() -> None:
    """The live run's lpt from solo 1, simulated with solo 1.2: the simulator is slower."""
    actions = [1, 0, 0, 1, 0, 0]
    base = replay(specs(), pool(), RATE, 1.0, SEED, 2.0, 1.0, records(actions))
    lpt = [s.latency_per_token for s in base]
    slower = replay(specs(), pool(), RATE, 1.0, SEED, 2.0, 1.2, records(actions))
    ratio = compare(records(actions, lpt), slower, ["slow", "fast"])
    assert ratio["experts"]["slow"]["median_ratio_live_to_sim"] < 0.9


def test_records_files_and_the_answer_cap(tmp_path: Path) -> None:
    path = tmp_path / "qos_drl-1.5.jsonl"
    live = records([1, 2, 1])
    path.write_text("".join(json.dumps(r) + "\n" for r in reversed(live)))
    assert [r["seq"] for r in read_records(path)] == [0, 1, 2]
    assert run_name(path) == ("qos_drl", 1.5)
    assert run_name(Path("baseline_rl-0.7.jsonl")) == ("baseline_rl", 0.7)
    assert [p.lengths for p in capped_pool(pool(2), 40)] == [(40, 30)] * 2
    assert capped_pool(pool(2), None) == pool(2)
