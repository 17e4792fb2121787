"""`bench.studies.qos.ablation`: the paper's Fig. 17 steps from qos_trace runs of three agents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.studies.qos.ablation import learning, main, summarize


def run(agent: float, baseline_rl: float, baseline: str = "b1.pt",
        bert: float = 0.2) -> dict[str, Any]:
    """A qos_trace run of one draw; `agent` is what it calls qos_drl."""
    fixed = {"bert_router": [bert], "round_robin": [0.1], "shortest_queue": [0.1]}
    row = {"avg_qos_mean": {"qos_drl": agent, "baseline_rl": baseline_rl, "bert_router": bert,
                            "round_robin": 0.1, "shortest_queue": 0.1},
           "avg_qos_draws": {"qos_drl": [agent], "baseline_rl": [baseline_rl], **fixed}}
    return {"table": {"poisson": {"5": row}}, "seeds": [7], "arrivals_per_draw": 600,
            "trace": "t", "fleet": {}, "limit_ms": 30.0, "predictions": "p",
            "checkpoint": "a.pt", "baseline_checkpoint": baseline}


def test_each_step_is_set_against_the_one_below_it_seed_by_seed() -> None:
    full = [run(0.45, 0.30), run(0.40, 0.40, baseline="b2.pt")]
    dsa = [run(0.36, 0.30), run(0.32, 0.40, baseline="b2.pt")]
    row = summarize(full, dsa)["poisson"]["5"]
    assert row["qos"] == {"baseline_rl": [0.30, 0.40], "dsa": [0.36, 0.32],
                          "qos_drl": [0.45, 0.40]}
    assert row["mean"]["dsa"] == pytest.approx(0.34)
    assert row["dsa_vs_baseline_rl"]["paired"] == pytest.approx([0.2, -0.2])
    assert row["qos_aware_vs_dsa"]["paired"] == pytest.approx([0.25, 0.25])
    assert row["qos_aware_vs_dsa"]["of_means"] == pytest.approx(0.425 / 0.34 - 1)
    assert row["qos_drl_vs_baseline_rl"]["of_means"] == pytest.approx(0.425 / 0.35 - 1)


def test_a_seed_whose_two_runs_saw_different_baselines_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Baseline RL b1\.pt against b2\.pt"):
        summarize([run(0.45, 0.30)], [run(0.36, 0.30, baseline="b2.pt")])
    with pytest.raises(ValueError, match="scores differ"):
        summarize([run(0.45, 0.30)], [run(0.36, 0.31)])
    with pytest.raises(ValueError, match="1 --full runs against 2"):
        summarize([run(0.45, 0.30)], [run(0.36, 0.30), run(0.36, 0.30)])
    with pytest.raises(ValueError, match="bert_router"):  # not the same draws
        summarize([run(0.45, 0.30)], [run(0.36, 0.30, bert=0.25)])


def test_learning_curves_average_the_seeds_then_each_window() -> None:
    curves = {"baseline_rl": [[0.1, 0.3, 0.5, 0.7, 0.9], [0.3, 0.5, 0.7, 0.9]],
              "dsa": [[0.0, 0.0, 0.2, 0.2], [0.2, 0.2, 0.4, 0.4, 0.6]]}
    # up to the shortest run (4 evaluations), windows of 2
    assert learning(curves, 2) == {"baseline_rl": pytest.approx([0.3, 0.7]),
                                   "dsa": pytest.approx([0.1, 0.3])}
    assert learning(curves, 3) == {"baseline_rl": pytest.approx([0.4]),
                                   "dsa": pytest.approx([(0.2 / 3 + 0.8 / 3) / 2])}


def test_main_draws_the_learning_curves_from_the_trainers_files_unless_told_not(
        tmp_path: Path) -> None:
    runs = {}
    for kind, agent, baseline in (("full", 0.45, 0.30), ("dsa", 0.36, 0.30)):
        run_ = run(agent, baseline, baseline=str(tmp_path / "b" / "best.pt"))
        run_["checkpoint"] = str(tmp_path / kind / "best.pt")
        runs[kind] = tmp_path / f"{kind}.json"
        runs[kind].write_bytes(orjson.dumps(run_))
    for name in ("b", "full", "dsa"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "curve.json").write_bytes(orjson.dumps(
            {"eval_step": [2000, 4000, 6000, 8000], "eval_qos": [0.1, 0.2, 0.3, 0.4]}))
    common = ["--full", str(runs["full"]), "--dsa", str(runs["dsa"]), "--window", "2"]
    assert main([*common, "--out", str(tmp_path / "a.json")]) == 0
    learned = orjson.loads((tmp_path / "a.json").read_bytes())["learning"]
    assert learned["window_steps"] == 4000
    assert learned["mean_eval_qos"]["dsa"] == pytest.approx([0.15, 0.35])
    assert (tmp_path / "a_learning.png").stat().st_size > 0
    assert main([*common, "--no-learning", "--out", str(tmp_path / "n.json")]) == 0
    assert orjson.loads((tmp_path / "n.json").read_bytes())["learning"] is None
    assert not (tmp_path / "n_learning.png").exists()
