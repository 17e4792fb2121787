"""The qos_drl policy: checkpoint loading, expert masking, the drop path (unit and through
the proxy: 503 request_dropped, the backend never contacted)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bench.fakes.fake_vllm import FakeConfig
from policies.base import PolicyLoadError, build_policy
from policies.qos_drl.policy import QosDrl
from policies.qos_drl.sac import SacAgent, SacConfig, load_checkpoint, save_checkpoint
from predictors.buckets import predictor as buckets
from proxy.types import NO_PREDICTION, Backend, BackendStats
from tests.policies.helpers import ctx, view
from tests.proxy.fakes import CHAT, fleet, post

EXPERTS = ["big", "small"]


def checkpoint(tmp_path: Path, favour: int, experts: list[str] = EXPERTS) -> Path:
    """A checkpoint whose actor strongly prefers action `favour` (0 = drop)."""
    torch.manual_seed(0)
    agent = SacAgent(SacConfig(n_experts=len(experts)))
    with torch.no_grad():
        agent.actor[-1].bias.zero_()
        agent.actor[-1].bias[favour] = 100.0
    path = tmp_path / f"agent-{favour}.pt"
    save_checkpoint(path, agent, {"experts": experts,
                                  "k": {e: [1e-4, 1e-7] for e in experts}})
    return path


def fleet_view(*models: str) -> tuple[tuple[Backend, ...], dict[str, BackendStats]]:
    backends = tuple(Backend(f"b-{m}", f"http://{m}", m) for m in models)
    stats = {b.name: BackendStats(running=1, kv_usage=0.2, healthy=True, updated_at=1.0)
             for b in backends}
    return backends, stats


def test_loads_the_checkpoint_and_routes_to_the_chosen_expert(tmp_path: Path) -> None:
    policy = build_policy("qos_drl", {"checkpoint": str(checkpoint(tmp_path, 2))})
    assert isinstance(policy, QosDrl) and policy.experts == EXPERTS
    backends, stats = fleet_view("big", "small")
    decision = policy.pick(ctx("hello there"), NO_PREDICTION, view(backends, stats=stats))
    assert decision.backend.model == "small" and decision.drop is None
    assert "small" in decision.reason


def test_an_expert_without_a_backend_is_never_chosen(tmp_path: Path) -> None:
    policy = build_policy("qos_drl", {"checkpoint": str(checkpoint(tmp_path, 2))})
    backends, stats = fleet_view("big")
    decision = policy.pick(ctx(), NO_PREDICTION, view(backends, stats=stats))
    assert decision.backend.model == "big"


def test_drop_is_a_decision_with_a_reason_unless_disabled(tmp_path: Path) -> None:
    path = str(checkpoint(tmp_path, 0))
    backends, stats = fleet_view("big", "small")
    dropping = build_policy("qos_drl", {"checkpoint": path})
    decision = dropping.pick(ctx(), NO_PREDICTION, view(backends, stats=stats))
    assert decision.drop is not None and "30 ms/token" in decision.drop
    kept = build_policy("qos_drl", {"checkpoint": path, "allow_drop": False})
    assert kept.pick(ctx(), NO_PREDICTION, view(backends, stats=stats)).drop is None


def test_expert_mapping_and_unknown_checkpoint(tmp_path: Path) -> None:
    policy = build_policy("qos_drl", {"checkpoint": str(checkpoint(tmp_path, 1)),
                                      "experts": {"llama-8b": "big", "llama-1b": "small"}})
    backends, stats = fleet_view("llama-1b", "llama-8b")
    assert policy.pick(ctx(), NO_PREDICTION, view(backends, stats=stats)).backend.model \
        == "llama-8b"
    with pytest.raises(PolicyLoadError, match=r"missing\.pt") as info:
        build_policy("qos_drl", {"checkpoint": str(tmp_path / "missing.pt")})
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_online_learning_updates_the_agent_from_outcomes(tmp_path: Path) -> None:
    policy = build_policy("qos_drl", {"checkpoint": str(checkpoint(tmp_path, 1)),
                                      "learn_online": True, "online_warmup": 4,
                                      "online_batch": 4, "online_thread": False})
    assert isinstance(policy, QosDrl) and policy.learner is not None
    backends, stats = fleet_view("big", "small")
    before = [p.clone() for p in policy.agent.q1.parameters()]
    for i in range(7):
        policy.pick(ctx(request_id=f"r{i}"), NO_PREDICTION, view(backends, stats=stats))
    assert policy.learner.updates == 3  # 7 picks: 6 transitions, an update from the 4th on
    after = list(policy.agent.q1.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


async def test_drop_becomes_an_openai_503_and_the_backend_is_not_called(
        tmp_path: Path) -> None:
    path = checkpoint(tmp_path, 0, experts=["fake"])
    async with fleet(FakeConfig(), policy={"name": "qos_drl",
                                           "params": {"checkpoint": str(path)}}) as (
            proxy, fakes):
        response = await post(proxy, CHAT)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "request_dropped" and error["type"] == "service_unavailable"
    assert "dropped by the routing policy" in error["message"]
    assert fakes[0].app.stats.requests == 0


def test_a_baseline_rl_checkpoint_routes_on_expert_level_features(tmp_path: Path) -> None:
    torch.manual_seed(0)
    agent = SacAgent(SacConfig(n_experts=2, graph=False))
    with torch.no_grad():
        agent.actor[-1].bias.zero_()
        agent.actor[-1].bias[1] = 100.0
    path = tmp_path / "baseline.pt"
    save_checkpoint(path, agent, {"experts": EXPERTS, "k": {e: [1e-4, 1e-7] for e in EXPERTS}})
    policy = build_policy("qos_drl", {"checkpoint": str(path)})
    backends, stats = fleet_view("big", "small")
    assert policy.pick(ctx(), NO_PREDICTION, view(backends, stats=stats)).backend.model == "big"


class _Buckets:
    """A stand-in bucket predictor: fixed predicted scores per expert."""

    experts = ("a", "b", "c")

    def __init__(self, scores: tuple[float, ...]) -> None:
        self.scores = scores

    def predict_batch(self, prompts: list[str]) -> list[Any]:
        return [SimpleNamespace(score=self.scores, length=(100.0,) * 3) for _ in prompts]


def test_bert_router_mode_picks_the_best_predicted_expert_with_a_backend(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    experts = list(_Buckets.experts)
    path = str(checkpoint(tmp_path, 0, experts=experts))  # the actor would drop: unused
    monkeypatch.setattr(buckets, "load_artifact", lambda *_, **__: _Buckets((0.2, 0.9, 0.9)))
    with pytest.raises(ValueError, match="needs a bucket predictor"):
        build_policy("qos_drl", {"checkpoint": path, "mode": "bert_router"})
    policy = build_policy("qos_drl", {"checkpoint": path, "buckets": "x",
                                      "mode": "bert_router"})
    backends, stats = fleet_view("a", "b", "c")
    picked = {policy.pick(ctx(request_id=f"r{i}"), NO_PREDICTION,
                          view(backends, stats=stats)).backend.model for i in range(20)}
    assert picked == {"b", "c"}  # the tie is broken at random, never towards "a"
    only_a, stats_a = fleet_view("a")
    decision = policy.pick(ctx(), NO_PREDICTION, view(only_a, stats=stats_a))
    assert decision.backend.model == "a" and decision.drop is None


class _CountingBuckets(_Buckets):
    def __init__(self, scores: tuple[float, ...]) -> None:
        super().__init__(scores)
        self.threads: list[str] = []

    def predict_batch(self, prompts: list[str]) -> list[Any]:
        import threading

        self.threads.append(threading.current_thread().name)
        return super().predict_batch(prompts)


def test_predictions_from_the_proxy_stage_are_used_as_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.types import Prediction

    experts = list(_Buckets.experts)
    path = str(checkpoint(tmp_path, 0, experts=experts))
    model = _CountingBuckets((0.2, 0.9, 0.1))
    monkeypatch.setattr(buckets, "load_artifact", lambda *_, **__: model)
    policy = build_policy("qos_drl", {"checkpoint": path, "buckets": "x",
                                      "mode": "bert_router"})
    backends, stats = fleet_view("a", "b", "c")
    staged = Prediction(expert_scores=(0.9, 0.1, 0.1), expert_lengths=(5.0,) * 3)
    assert policy.pick(ctx(), staged, view(backends, stats=stats)).backend.model == "a"
    failed = Prediction(expert_scores=(), expert_lengths=())  # the stage gave up: zeros
    picked = {policy.pick(ctx(request_id=f"r{i}"), failed, view(backends, stats=stats)
                          ).backend.model for i in range(20)}
    assert picked == {"a", "b", "c"} and model.threads == []  # never computed in pick
    assert policy.pick(ctx(), NO_PREDICTION, view(backends, stats=stats)).backend.model == "b"
    assert len(model.threads) == 1  # no stage ran: the policy predicts itself


async def test_through_the_proxy_the_encoder_runs_in_the_stage_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    experts = list(_Buckets.experts)
    path = str(checkpoint(tmp_path, 0, experts=experts))
    model = _CountingBuckets((0.2, 0.9, 0.1))
    monkeypatch.setattr(buckets, "load_artifact", lambda *_, **__: model)
    async with fleet(*(FakeConfig(model=m) for m in experts),
                     model_groups={"experts": experts},
                     policy={"name": "qos_drl", "params": {
                         "checkpoint": path, "buckets": "x", "mode": "bert_router"}}) as (
            proxy, _):
        answers = [await post(proxy, {**CHAT, "model": "experts"}) for _ in range(3)]
    assert [r.status_code for r in answers] == [200] * 3
    assert {r.headers["x-laneway-backend"] for r in answers} == {"f1"}  # expert "b"
    assert model.threads == ["laneway-buckets_0"] * 3


def test_the_bucket_runtime_params_and_the_deprecated_int8_form(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from policies.qos_drl.policy import QosDrlParams

    path = str(checkpoint(tmp_path, 0, experts=list(_Buckets.experts)))
    loaded: list[tuple[str, int | None, int]] = []

    def load(_: Path, runtime: str, max_len: int | None, threads: int,
             estimate: str) -> _Buckets:
        loaded.append((runtime, max_len, threads))
        return _Buckets((0.5,) * 3)

    monkeypatch.setattr(buckets, "load_artifact", load)
    for given, runtime in (({}, "onnx-int8"), ({"buckets_runtime": "torch"}, "torch"),
                           ({"buckets_int8": True}, "torch-int8"),
                           ({"buckets_int8": False}, "torch")):
        build_policy("qos_drl", {"checkpoint": path, "buckets": "x", **given})
        assert loaded.pop() == (runtime, None, 1)
    build_policy("qos_drl", {"checkpoint": path, "buckets": "x", "buckets_max_len": 64,
                             "buckets_threads": 2})
    assert loaded.pop() == ("onnx-int8", 64, 2)
    with pytest.raises(ValidationError, match="contradicts"):
        QosDrlParams(checkpoint=path, buckets_int8=True, buckets_runtime="onnx-int8")
    with pytest.raises(ValidationError, match="buckets_runtime"):
        QosDrlParams(checkpoint=path, buckets_runtime="onnx-int4")  # type: ignore[arg-type]


def test_the_bucket_estimate_is_the_checkpoint_s_unless_a_param_names_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    experts = list(_Buckets.experts)
    estimates: list[str] = []

    def load(_: Path, runtime: str, max_len: int | None, threads: int,
             estimate: str) -> _Buckets:
        estimates.append(estimate)
        return _Buckets((0.5,) * 3)

    monkeypatch.setattr(buckets, "load_artifact", load)
    old = str(checkpoint(tmp_path, 0, experts=experts))  # before --bucket-estimate
    torch.manual_seed(0)
    trained = tmp_path / "expected.pt"
    save_checkpoint(trained, SacAgent(SacConfig(n_experts=3)),
                    {"experts": experts, "k": {e: [1e-4, 1e-7] for e in experts},
                     "bucket_estimate": "expected"})
    for path, given in ((old, {}), (str(trained), {}),
                        (str(trained), {"buckets_estimate": "midpoint"}),
                        (old, {"buckets_estimate": "expected"})):
        build_policy("qos_drl", {"checkpoint": path, "buckets": "x", **given})
    assert estimates == ["midpoint", "expected", "midpoint", "expected"]


def online_policy(start: Path, save: Path, **params: Any) -> QosDrl:
    policy = build_policy("qos_drl", {"checkpoint": str(start), "learn_online": True,
                                      "online_warmup": 2, "online_batch": 2,
                                      "online_report_every": 2, "online_save": str(save),
                                      "online_thread": False, **params})
    assert isinstance(policy, QosDrl)
    return policy


def test_online_learning_reports_and_saves_what_it_learned(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    start, saved = checkpoint(tmp_path, 1), tmp_path / "online" / "agent.pt"
    policy = online_policy(start, saved)
    backends, stats = fleet_view("big", "small")
    with caplog.at_level("INFO", logger="policies.qos_drl.policy"):
        for i in range(7):  # 6 transitions, an update from the 2nd: 5, reports at 2 and 4
            policy.pick(ctx(request_id=f"r{i}"), NO_PREDICTION, view(backends, stats=stats))
    assert policy.learner is not None and policy.learner.updates == 5
    reports = [r.getMessage() for r in caplog.records if "qos_drl online" in r.getMessage()]
    assert len(reports) == 2 and reports[1].startswith("qos_drl online: 4 updates")
    assert f"saved to {saved}" in reports[1] and not saved.with_name("agent.pt.partial").exists()
    learned, meta = load_checkpoint(saved)
    original, _ = load_checkpoint(start)
    assert meta["online_updates"] == 4 and meta["online_from"] == str(start)
    assert meta["experts"] == EXPERTS
    assert any(not torch.equal(a, b) for a, b in zip(
        learned.q1.parameters(), original.q1.parameters(), strict=True))
    # a restart from the saved agent counts on and still names the first checkpoint
    again = online_policy(saved, saved)
    for i in range(4):  # 3 transitions, updates 2
        again.pick(ctx(request_id=f"s{i}"), NO_PREDICTION, view(backends, stats=stats))
    _, meta = load_checkpoint(saved)
    assert meta["online_updates"] == 6 and meta["online_from"] == str(start)


def test_an_online_save_that_fails_never_fails_a_decision(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a-file").write_text("")
    policy = online_policy(checkpoint(tmp_path, 1), tmp_path / "a-file" / "x.pt")
    backends, stats = fleet_view("big", "small")
    with caplog.at_level("INFO", logger="policies.qos_drl.policy"):
        decisions = [policy.pick(ctx(request_id=f"r{i}"), NO_PREDICTION,
                                 view(backends, stats=stats)) for i in range(4)]
    assert [d.backend.model for d in decisions] == ["big"] * 4
    (warning,) = [r for r in caplog.records if "qos_drl online" in r.getMessage()]
    assert warning.levelname == "WARNING" and "not saved to" in warning.getMessage()


def test_online_save_needs_online_learning(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="online_save needs learn_online"):
        build_policy("qos_drl", {"checkpoint": str(checkpoint(tmp_path, 1)),
                                 "online_save": str(tmp_path / "x.pt")})


def test_online_updates_run_beside_the_decisions_which_act_on_a_fresh_copy(
        tmp_path: Path) -> None:
    """In its own thread (the default) the learner trains while decisions go on: a
    decision never waits for an update, and each update hands decisions a new copy."""
    policy = online_policy(checkpoint(tmp_path, 1), tmp_path / "agent.pt",
                           online_thread=True, online_report_every=1000)
    assert policy.learner is not None
    backends, stats = fleet_view("big", "small")
    first = policy.learner.acting
    for i in range(6):  # 5 transitions: 4 updates owed
        policy.pick(ctx(request_id=f"r{i}"), NO_PREDICTION, view(backends, stats=stats))
    assert policy.learner.wait_idle(30) and policy.learner.updates == 4
    assert policy.learner.acting is not first and policy.learner.skipped == 0
    # the critics' loss trains the shared encoder (this actor is saturated on one action)
    assert any(not torch.equal(a, b) for a, b in zip(
        policy.learner.acting.encoder.parameters(), first.encoder.parameters(), strict=True))
    decision = policy.pick(ctx(request_id="r6"), NO_PREDICTION, view(backends, stats=stats))
    assert decision.backend.model == "big"


def test_a_backend_of_no_expert_is_said_once_and_never_picked(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # the actor wants `big`, which has no backend, and may not drop: `small` it is,
    # never the backend of a model the checkpoint does not know
    policy = build_policy("qos_drl", {"checkpoint": str(checkpoint(tmp_path, 1)),
                                      "allow_drop": False})
    backends, stats = fleet_view("other", "small")
    with caplog.at_level("WARNING", logger="policies.qos_drl.policy"):
        picked = {policy.pick(ctx(request_id=f"r{i}"), NO_PREDICTION,
                              view(backends, stats=stats)).backend.model for i in range(3)}
    assert picked == {"small"}
    warnings = [r.getMessage() for r in caplog.records if "not an expert" in r.getMessage()]
    assert len(warnings) == 1 and "b-other serves other" in warnings[0]
    assert "big, small" in warnings[0] and "`experts` param" in warnings[0]
