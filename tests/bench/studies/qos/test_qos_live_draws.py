"""bench.studies.qos.live_draws: which live results it reuses, the gains and the merge."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from bench.studies.qos import live_draws as qos_live_draws
from bench.studies.qos.live_draws import default_checkpoints, live_qos, markdown, merge, summarize
from bench.studies.qos.live_report import repo_path
from bench.studies.qos.train import default_checkpoint


def agents_by_path(checkpoint: Path, baseline: Path) -> dict[str, str]:
    """agents_of without the digests (these tests' checkpoints are names only)."""
    return {"checkpoint": repo_path(checkpoint), "baseline_checkpoint": repo_path(baseline)}


def live_json(path: Path, seed: int, table: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"seed": seed, "arrivals_per_run": 600, "table": table}))
    return path


ROW = {"qos_drl": {"avg_qos": 0.36}, "baseline_rl": {"avg_qos": 0.30}}


def test_live_qos_reads_only_its_own_draw_and_rate_with_both_agents(tmp_path: Path) -> None:
    path = live_json(tmp_path / "a.json", 8, {"5": ROW, "8": {"qos_drl": {"avg_qos": 0.2}}})
    assert live_qos(path, 8, "5", 600) == {"qos_drl": 0.36, "baseline_rl": 0.30}
    assert live_qos(path, 7, "5", 600) is None  # another seed
    assert live_qos(path, 8, "5", 300) is None  # another number of arrivals
    assert live_qos(path, 8, "8", 600) is None  # Baseline RL not run at λ 8
    assert live_qos(path, 8, "2", 600) is None
    assert live_qos(tmp_path / "missing.json", 8, "5", 600) is None


def test_live_qos_reads_only_the_agents_it_was_asked_for(tmp_path: Path) -> None:
    old = live_json(tmp_path / "old.json", 7, {"5": ROW})  # recorded no checkpoints
    assert live_qos(old, 7, "5", 600) == {"qos_drl": 0.36, "baseline_rl": 0.30}
    paper = {"checkpoint": ".laneway/policies/qos-drl-paper/best.pt",
             "baseline_checkpoint": ".laneway/policies/qos-baseline-rl-paper/best.pt"}
    assert live_qos(old, 7, "5", 600, paper) is None  # made with the default agents
    data = json.loads(old.read_text()) | paper
    new = tmp_path / "new.json"
    new.write_text(json.dumps(data))
    assert live_qos(new, 7, "5", 600, paper) == {"qos_drl": 0.36, "baseline_rl": 0.30}
    assert live_qos(new, 7, "5", 600) is None
    # with digests, the same paths after a retraining are other agents
    digests = {"checkpoint_sha256": "aa", "baseline_checkpoint_sha256": "bb"}
    new.write_text(json.dumps(data | digests))
    assert live_qos(new, 7, "5", 600, paper | digests) == {"qos_drl": 0.36,
                                                           "baseline_rl": 0.30}
    assert live_qos(new, 7, "5", 600, paper | digests | {"checkpoint_sha256": "cc"}) is None
    # a file without digests is of weights no longer known: not these, whatever its paths
    assert live_qos(old, 7, "5", 600, default_checkpoints() | digests) is None


def draws() -> list[dict[str, Any]]:
    return [{"seed": 7, "live": {"qos_drl": 0.33, "baseline_rl": 0.30},
             "simulated": {"qos_drl": 0.345, "baseline_rl": 0.30},
             "gain_live": 0.1, "gain_simulated": 0.15},
            {"seed": 8, "live": {"qos_drl": 0.27, "baseline_rl": 0.30},
             "simulated": {"qos_drl": 0.33, "baseline_rl": 0.30},
             "gain_live": -0.1, "gain_simulated": 0.1}]


def test_summary_and_table() -> None:
    summary = summarize(draws())
    assert summary["gain_live_mean"] == pytest.approx(0.0)
    assert (summary["gain_live_min"], summary["gain_live_max"]) == (-0.1, 0.1)
    assert summary["gain_simulated_mean"] == pytest.approx(0.125)
    assert summary["draws_live_ahead"] == 1
    text = markdown({"lambda": 5.0, "arrivals": 600, "draws": draws(), "summary": summary})
    assert "| 8 | 0.270 / 0.300 | -10.0% | 0.330 / 0.300 | +10.0% |" in text
    assert "range -10.0% to +10.0%" in text


def test_merge_keeps_the_full_runs_headline(tmp_path: Path) -> None:
    path = tmp_path / "qos_drl.json"
    path.write_text(json.dumps({"qos_gain_vs_baseline_rl": 0.078, "training_steps": 5}))
    result = {"lambda": 5.0, "arrivals": 600, "draws": draws(),
              "summary": summarize(draws()), "command": "c", "commit": "x",
              **agents_by_path(Path("q.pt"), Path("b.pt")),
              "checkpoint_sha256": "aa", "baseline_checkpoint_sha256": "bb"}
    merge(path, result)
    data = json.loads(path.read_text())
    assert data["qos_gain_vs_baseline_rl"] == 0.078 and data["training_steps"] == 5
    assert data["qos_gain_vs_baseline_rl_live_draws_mean"] == pytest.approx(0.0)
    assert [d["seed"] for d in data["live_draws"]["draws"]] == [7, 8]


def test_a_draw_reuses_the_full_run_or_an_earlier_result_and_runs_nothing_live(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = live_json(tmp_path / "qos_live.json", 7, {"5": ROW})
    live_json(tmp_path / "draws" / "seed8" / "qos_live.json", 8,
              {"5": {"qos_drl": {"avg_qos": 0.25}, "baseline_rl": {"avg_qos": 0.25}}})

    def no_live_run(argv: list[str]) -> int:
        raise AssertionError(f"ran live: {argv}")

    monkeypatch.setattr(qos_live_draws, "agents_of", agents_by_path)
    monkeypatch.setattr(qos_live_draws.qos_live, "main", no_live_run)
    monkeypatch.setattr(qos_live_draws, "simulated_qos",
                        lambda args, seed, out: {"qos_drl": 0.4, "baseline_rl": 0.32})
    args = argparse.Namespace(rate=5.0, arrivals=600, dir=tmp_path / "draws", full_run=full,
                              checkpoint=default_checkpoint(False),
                              baseline_checkpoint=default_checkpoint(True))
    seven, eight = qos_live_draws.draw(args, 7), qos_live_draws.draw(args, 8)
    assert (seven["gain_live"], seven["gain_simulated"]) == (0.2, 0.25)
    assert eight["live"] == {"qos_drl": 0.25, "baseline_rl": 0.25}
    assert eight["gain_live"] == 0.0


def test_a_missing_draw_runs_live_with_the_agents_asked_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the default agents' draw is there, but these are other agents: it is run again
    full = live_json(tmp_path / "qos_live.json", 7, {"5": ROW})
    calls: list[list[str]] = []

    def live_run(argv: list[str]) -> int:
        calls.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        live_json(out, 7, {"5": {"qos_drl": {"avg_qos": 0.5}, "baseline_rl": {"avg_qos": 0.4}}})
        data = json.loads(out.read_text())
        data["checkpoint"] = repo_path(Path(argv[argv.index("--checkpoint") + 1]))
        data["baseline_checkpoint"] = repo_path(
            Path(argv[argv.index("--baseline-checkpoint") + 1]))
        out.write_text(json.dumps(data))
        return 0

    monkeypatch.setattr(qos_live_draws, "agents_of", agents_by_path)
    monkeypatch.setattr(qos_live_draws.qos_live, "main", live_run)
    monkeypatch.setattr(qos_live_draws, "simulated_qos",
                        lambda args, seed, out: {"qos_drl": 0.4, "baseline_rl": 0.4})
    args = argparse.Namespace(rate=5.0, arrivals=600, dir=tmp_path / "draws", full_run=full,
                              data=tmp_path / "data.jsonl", checkpoint=Path("paper/best.pt"),
                              baseline_checkpoint=Path("paper-baseline/best.pt"))
    row = qos_live_draws.draw(args, 7)
    assert len(calls) == 1 and "paper/best.pt" in calls[0]
    assert row["live"] == {"qos_drl": 0.5, "baseline_rl": 0.4}
