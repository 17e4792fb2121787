"""The chaos run's harness: a short run on fake backends, and its checks."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench.harness.services import MissingService, binary
from bench.studies.chaos import Plan, Run, run, table


def test_a_short_run_on_fakes_answers_every_request_right(tmp_path: Path) -> None:
    """Kills, drains, removals and reloads every 1-2 s: every answer is the backend's
    own, and the kills show as moves of streams cut mid-way."""
    result = run(Plan(seconds=14, concurrency=6, prompts=6, action_every_s=(1.0, 2.0),
                      seed=3, fake=True), log_dir=tmp_path)
    answers, actions = result["answers"], result["actions"]
    assert answers.get("wrong", 0) == 0 and answers.get("error", 0) == 0, result["wrong"]
    assert answers["ok"] > 100 and answers["left"] > 0
    assert sum(actions.values()) >= 4 and actions.get("kill", 0) >= 1, actions
    assert all(label.endswith((" 200", " 201")) for label in result["admin"]), result
    assert result["moves"].get("forced", 0) > 0 and result["meets_targets"]
    assert "| answers right" in table(result)


def test_two_replicas_restarted_in_turn_on_a_redis_killed_in_turn_lose_nothing(
        tmp_path: Path) -> None:
    """Two laneway processes on one Redis, with strict flow control (3 requests per
    backend for 8 clients: requests wait in the replicas' queues): besides the
    backends' troubles, one replica restarted (its streams finish; the clients send to
    the other meanwhile) and Redis killed and started again, empty; every answer right,
    and nothing left in flight."""
    try:
        binary("redis-server")
    except MissingService as exc:
        pytest.skip(str(exc))
    result = run(Plan(seconds=16, concurrency=8, prompts=6, action_every_s=(1.0, 2.0),
                      seed=3, fake=True, replicas=2, max_inflight=3), log_dir=tmp_path)
    answers, actions = result["answers"], result["actions"]
    assert answers.get("wrong", 0) == 0 and answers.get("error", 0) == 0, result["wrong"]
    assert answers["ok"] > 100
    assert actions.get("replica", 0) >= 1 and actions.get("redis", 0) >= 1, actions
    assert result["resent_to_another_replica"].get("refused", 0) > 0, result
    # every answer was logged once, by one replica: none served twice
    assert result["access_lines"] == answers["ok"] + answers["left"]
    assert result["served_twice"] == []
    assert set(result["inflight_after"]) == {"0 inflight", "0 cluster_inflight",
                                             "1 inflight", "1 cluster_inflight"}
    assert not any(result["inflight_after"].values()) and result["meets_targets"]
    assert set(result["backend_requests_max"]) == {"fake-0", "fake-1", "fake-2"}


def test_a_wrong_answer_and_an_error_are_counted_with_what_came() -> None:
    plan = Plan(fake=True)
    fake: Any = SimpleNamespace(names=[])
    checked = Run(plan, fake, fake, ["p"], [4], {("chat", 0): ("a b", "length", 4)})
    checked._check("chat_stream", 0, {}, ("a b", "length", 4))
    checked._check("chat_stream", 0, {"x-request-id": "r"}, ("a c", "length", 4))
    checked._check("chat_whole", 0, {}, "HTTP 502: no")
    checked._check("chat_stream", 0, {}, None)
    assert dict(checked.answers) == {"ok": 1, "wrong": 1, "error": 1, "left": 1}
    assert [w["got"] for w in checked.wrong] == [["a c", "length", 4], "HTTP 502: no"]
