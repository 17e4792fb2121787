"""The live qos_drl evaluation: arrivals equal to the simulator's, QoS and latency per
token from the client's token times, drops, the summary, the report and its merge; and
one small run through `laneway serve` against an emulated two-expert fleet."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import orjson
import pytest

from bench.emulator.profile import load_profile
from bench.studies.qos import live_report as qos_live_report
from bench.studies.qos.live import (
    agent_option,
    cores_used,
    emulated_fleet,
    evaluate_live,
    policy_config,
    proxy_config,
    real_variants,
)
from bench.studies.qos.live_client import (
    LiveRecord,
    account,
    failed,
    is_drop,
    schedule,
    token_count,
)
from bench.studies.qos.live_report import (
    GAIN_NOTE,
    beats_all,
    carried_over,
    markdown,
    merge,
    report,
    summarize,
)
from bench.studies.qos.setup import fit_coefficients
from bench.studies.qos.sim import ExpertSpec, PoolPrompt, QosSim, TraceArrivals

EXPERTS = ["fast", "slow"]


def dropping_agent(tmp_path: Path) -> str:
    """A qos_drl checkpoint whose actor always drops."""
    import torch

    from policies.qos_drl.sac import SacAgent, SacConfig, save_checkpoint

    agent = SacAgent(SacConfig(n_experts=len(EXPERTS)))
    with torch.no_grad():
        agent.actor[-1].bias.zero_()
        agent.actor[-1].bias[0] = 100.0
    path = tmp_path / "drop.pt"
    save_checkpoint(path, agent, {"experts": EXPERTS, "k": {e: [1e-4, 1e-7] for e in EXPERTS}})
    return str(path)


def pool(n: int = 8) -> list[PoolPrompt]:
    return [PoolPrompt(i, 4, (0.9, 0.3), (12 + i, 20), (0.9, 0.3), (12.0, 20.0))
            for i in range(n)]


def texts(n: int = 8) -> dict[int, str]:
    return {i: f"prompt number {i} about routing" for i in range(n)}


def test_arrivals_are_the_simulators_for_the_same_seed() -> None:
    profile = load_profile("tiny-llama-small")
    sim = QosSim([ExpertSpec(e, profile, fit_coefficients(profile)) for e in EXPERTS],
                 pool(), rate=5.0, limit_s=0.03, seed=7)
    expected = []
    for _ in range(30):
        arrived = sim.arrive()
        expected.append((arrived.arrival, arrived.prompt.id))
        sim.route(0)
    requests = schedule(pool(), texts(), 5.0, 30, seed=7, cap=15)
    assert [r.prompt.id for r in requests] == [prompt_id for _, prompt_id in expected]
    assert [r.arrival_s for r in requests] == pytest.approx([at for at, _ in expected])
    assert {r.max_tokens for r in requests} == {15}  # max over experts 20, capped
    assert requests[0].text == texts()[requests[0].prompt.id]


def test_tokens_are_counted_from_token_ids_else_text_events() -> None:
    def event(**choice: object) -> bytes:
        return orjson.dumps({"choices": [{"index": 0, **choice}]})

    assert token_count(event(text="a b c", token_ids=[5, 6, 7])) == 3
    assert token_count(event(text="tok1 ", token_ids=None)) == 1
    assert token_count(event(delta={"content": ""})) == 0
    assert token_count(orjson.dumps({"choices": [], "usage": {"completion_tokens": 9}})) == 0


def test_qos_is_the_serving_experts_score_within_the_limit() -> None:
    request = schedule(pool(), texts(), 5.0, 1, seed=0)[0]
    fast = account(request, 0, needed=10, sent=100.0, reached=100.2, limit_s=0.03)
    assert fast.lpt_s == pytest.approx(0.02) and fast.score == 0.9 and fast.qos == 0.9
    slow = account(request, 1, needed=10, sent=100.0, reached=100.5, limit_s=0.03)
    assert slow.lpt_s == pytest.approx(0.05) and slow.score == 0.3 and slow.qos == 0.0
    cut = account(request, 0, 10, 100.0, None, 0.03, "stream ended after 4 of 10 tokens")
    assert cut.lpt_s is None and cut.qos == 0.0 and cut.error is not None


def test_only_a_503_request_dropped_is_a_drop() -> None:
    def body(code: str) -> bytes:
        return orjson.dumps({"error": {"message": "m", "type": "t", "code": code}})

    assert is_drop(503, body("request_dropped"))
    assert not is_drop(503, body("no_healthy_backend"))
    assert not is_drop(500, body("request_dropped"))
    assert not is_drop(503, b"upstream says no")


def records() -> list[LiveRecord]:
    request = schedule(pool(), texts(), 5.0, 1, seed=0)[0]
    return [account(request, 0, 10, 0.0, 0.2, 0.03),  # QoS 0.9, 20 ms
            account(request, 1, 10, 0.0, 0.4, 0.03),  # QoS 0 (40 ms > L)
            failed(request, True, None),  # drop
            failed(request, False, "HTTP 502: boom")]


def test_summary_counts_drops_and_failures_as_zero() -> None:
    row = summarize(records(), 2, 0.03)
    assert row["avg_qos"] == pytest.approx(0.9 / 4)
    assert row["drop_rate"] == 0.25 and row["error_rate"] == 0.25
    assert row["lpt_p50_ms"] == pytest.approx(30.0) and row["within_limit"] == 0.5
    assert row["expert_share"] == [0.25, 0.25] and row["arrivals"] == 4


def test_report_gain_at_the_middle_lambda_and_merge_keeps_existing_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qos_live_report, "REPO", tmp_path / "repo")
    checkpoint, baseline = tmp_path / "repo/.laneway/policies/a/best.pt", tmp_path / "b.pt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"agent a")
    baseline.write_bytes(b"agent b")

    def row(qos_drl: float, baseline: float) -> dict[str, dict[str, object]]:
        base = summarize(records(), 2, 0.03)
        return {"qos_drl": {**base, "avg_qos": qos_drl},
                "baseline_rl": {**base, "avg_qos": baseline}}

    args = argparse.Namespace(reference_rate=None, fleet="emulated", variants="small",
                              limit_ms=30.0, arrivals=4, seed=7,
                              checkpoint=checkpoint, baseline_checkpoint=baseline)
    table = {"2": row(0.3, 0.2), "5": row(0.3, 0.4), "8": row(0.1, 0.1)}
    result = report(args, EXPERTS, table, None, {e: "t4" for e in EXPERTS})
    assert result["reference_lambda"] == 5.0
    assert result["fleet"] == {"kind": "emulated", "backends": {e: "t4" for e in EXPERTS}}
    assert result["qos_gain_vs_baseline_rl_live"] == pytest.approx(-0.25)
    assert result["avg_qos"]["2"] == {"qos_drl": 0.3, "baseline_rl": 0.2}
    # the agents, by repository path when inside it, and by digest (draws and simulator
    # re-runs are matched on them)
    assert result["checkpoint"] == ".laneway/policies/a/best.pt"
    assert result["baseline_checkpoint"] == str(baseline)
    assert result["checkpoint_sha256"] == hashlib.sha256(b"agent a").hexdigest()[:16]
    assert result["baseline_checkpoint_sha256"] != result["checkpoint_sha256"]
    simulated = tmp_path / "qos_drl.json"
    simulated.write_text(json.dumps({"qos_gain_vs_baseline_rl_sim": -0.33, "commit": "abc",
                                     "qos_gain_vs_baseline_rl_note": "live not done"}))
    merge(simulated, result)
    merged = json.loads(simulated.read_text())
    assert merged["qos_gain_vs_baseline_rl_sim"] == -0.33 and merged["commit"] == "abc"
    assert merged["qos_gain_vs_baseline_rl_note"] == GAIN_NOTE
    assert merged["qos_gain_vs_baseline_rl_live"] == pytest.approx(-0.25)
    assert merged["qos_gain_vs_baseline_rl"] == merged["qos_gain_vs_baseline_rl_live"]
    assert merged["beats_all_baselines_every_lambda_live"] is False  # 0.3 < 0.4 at λ=5
    assert beats_all({"2": row(0.3, 0.2), "8": row(0.2, 0.1)}) is True
    assert beats_all({"2": row(0.3, 0.3)}) is False and beats_all({}) is None
    # another agent of the run (--agent) is no baseline of qos_drl's
    other = {"2": {**row(0.3, 0.2), "qos_drl_other": {"avg_qos": 0.9}}}
    assert beats_all(other) is True
    assert merged["live"]["table"]["5"]["baseline_rl"]["avg_qos"] == 0.4
    assert merged["live"]["checkpoint_sha256"] == result["checkpoint_sha256"]
    real = {**result, "qos_gain_vs_baseline_rl_live": 0.5}
    merge(simulated, real, "live_real")  # the real fleet's run sits beside the emulated one
    merged = json.loads(simulated.read_text())
    assert merged["qos_gain_vs_baseline_rl_live_real"] == 0.5
    assert merged["qos_gain_vs_baseline_rl"] == pytest.approx(-0.25)
    assert "live" in merged and "live_real" in merged
    text = markdown(result)
    assert "| 5 | qos_drl | 0.300 | 25.0% | 25.0% |" in text and "-25.0%" in text
    assert "Poisson arrivals per run (seed" in text
    bursts = markdown({**result, "arrival_process": "traces/t.jsonl, in bursts"})
    assert "arrivals of the trace traces/t.jsonl, in bursts, per run (seed" in bursts


def test_a_simulator_rerun_keeps_only_the_live_runs_of_its_own_agents() -> None:
    agents = {"checkpoint": "q.pt", "checkpoint_sha256": "aa",
              "baseline_checkpoint": "b.pt", "baseline_checkpoint_sha256": "bb"}
    retrained = agents | {"checkpoint_sha256": "cc"}  # the same path, other weights
    previous = {"qos_gain_vs_baseline_rl_live": 0.1, "beats_all_baselines_every_lambda_live":
                True, "live": dict(agents), "qos_gain_vs_baseline_rl_live_real": 0.2,
                "live_real": {"commit": "x"},  # the tiny fleet's own agents: always kept
                "live_draws": {"draws": []},  # names no agents: of ones no longer known
                "qos_gain_vs_baseline_rl_live_draws_mean": 0.3, "training_steps": 5}
    kept = carried_over(previous, agents)
    assert set(kept) == {"qos_gain_vs_baseline_rl_live", "beats_all_baselines_every_lambda_live",
                         "live", "qos_gain_vs_baseline_rl_live_real", "live_real"}
    assert set(carried_over(previous, retrained)) == {"qos_gain_vs_baseline_rl_live_real",
                                                      "live_real"}
    previous["live_draws"] |= agents
    assert "qos_gain_vs_baseline_rl_live_draws_mean" in carried_over(previous, agents)


def test_a_small_live_run_through_the_proxy(tmp_path: Path) -> None:
    """Round robin alternates the two experts, each request is read to its expert's
    length and the backends generate no more than that; a dropping agent drops all."""
    policies = {"round_robin": {"name": "round_robin", "params": {}},
                "drop": {"name": "qos_drl", "params": {"checkpoint": dropping_agent(tmp_path)}}}
    requests = {20.0: schedule(pool(), texts(), 20.0, 6, seed=3)}
    profiles = {"fast": "h100-80gb", "slow": "t4"}
    table = evaluate_live(lambda: emulated_fleet(EXPERTS, profiles), EXPERTS, policies,
                          requests, limit_s=10.0, cap=None, records_dir=tmp_path / "rec")
    served, dropped = table["20"]["round_robin"], table["20"]["drop"]
    assert served["error_rate"] == 0 and served["drop_rate"] == 0
    assert served["expert_share"] == [0.5, 0.5]
    lines = (tmp_path / "rec" / "round_robin-20.jsonl").read_text().splitlines()
    done = [json.loads(line) for line in lines]
    assert all(r["needed"] == pool()[r["prompt_id"]].lengths[r["expert"]] for r in done)
    assert served["avg_qos"] == pytest.approx(sum(r["score"] for r in done) / 6)
    assert 0 < served["lpt_p50_ms"] < 10_000
    assert 1.0 <= served["backend_tokens_over_needed"] < 1.5  # the proxy cancelled at d
    assert served["emulator_lag_ms_per_step"] >= 0
    assert dropped["drop_rate"] == 1 and dropped["avg_qos"] == 0
    assert dropped["expert_share"] == [0, 0]
    # the CPU account names the emulator, the proxy, the client and the machine
    cpu = served["cpu_cores"]
    assert {"emulator", "emulator+", "proxy", "proxy+", "client", "machine",
            "other"} <= set(cpu)
    assert cpu["emulator"] > 0 and cpu["proxy"] > 0 and cpu["client"] > 0
    assert 0 < cpu["machine"] <= (os.cpu_count() or 1) + 0.1


def test_cores_used_per_part_and_the_rest_of_the_machine() -> None:
    before = {"a": 1.0, "a+": 0.0, "client": 2.0, "machine": 10.0}
    after = {"a": 3.0, "a+": 1.0, "client": 2.5, "machine": 16.0}
    assert cores_used(before, after, wall=4.0) == {
        "a": 0.5, "a+": 0.25, "client": 0.125, "machine": 1.5, "other": 0.625}


def test_proxy_config_groups_the_experts_without_migration() -> None:
    backends = [{"name": e, "url": f"http://{e}", "model": e} for e in EXPERTS]
    config = proxy_config(backends, EXPERTS, {"name": "round_robin", "params": {}})
    assert config["model_groups"] == {"experts": EXPERTS}
    assert config["migration"] == {"enabled": False}


def test_the_rl_agents_and_the_bert_router_are_the_qos_drl_policy(tmp_path: Path) -> None:
    agent = dropping_agent(tmp_path)
    (tmp_path / "buckets").mkdir()
    (tmp_path / "buckets" / "meta.json").write_text("{}")
    args = argparse.Namespace(buckets=tmp_path / "buckets", checkpoint=Path(agent),
                              baseline_checkpoint=Path(agent), limit_ms=25.0,
                              agent=[agent_option(f"other={tmp_path / 'other.pt'}")])
    assert policy_config("qos_drl", args) == {"name": "qos_drl", "params": {
        "checkpoint": agent, "buckets": str(tmp_path / "buckets"), "limit_ms": 25.0}}
    assert policy_config("bert_router", args)["params"]["mode"] == "bert_router"
    assert "buckets" not in policy_config("baseline_rl", args)["params"]
    assert policy_config("round_robin", args) == {"name": "round_robin", "params": {}}
    with pytest.raises(SystemExit, match="no checkpoint"):  # --agent other=…, not written
        policy_config("other", args)
    args.agent = [agent_option(f"other={agent}")]
    assert policy_config("other", args) == policy_config("qos_drl", args)
    for bad in ("qos_drl=x.pt", "x.pt", "other="):
        with pytest.raises(argparse.ArgumentTypeError, match="LABEL=CHECKPOINT"):
            agent_option(bad)
    args.buckets = tmp_path / "none"
    with pytest.raises(SystemExit, match="bucket predictor"):
        policy_config("bert_router", args)
    args.checkpoint = tmp_path / "missing.pt"
    with pytest.raises(SystemExit, match="no checkpoint"):
        policy_config("qos_drl", args)


def test_real_variants_follow_the_trained_fleet_or_the_cycle() -> None:
    tiny = {"fast": "tiny-llama-small", "slow": "tiny-llama-large"}
    assert real_variants(EXPERTS, tiny, None) == [tiny[e].split("-")[-1] for e in EXPERTS]
    assert real_variants(EXPERTS, {"fast": "t4", "slow": "t4"}, "large") == ["large"] * 2
    with pytest.raises(SystemExit, match="GPU profiles"):
        real_variants(EXPERTS, {"fast": "t4", "slow": "tiny-llama-large"}, None)


def test_trace_arrivals_are_the_simulators_for_the_same_seed() -> None:
    times = tuple(float(3 * (i // 5)) for i in range(80))
    for spread in (True, False):
        trace = TraceArrivals(times, window=40, spread=spread)
        profile = load_profile("tiny-llama-small")
        sim = QosSim([ExpertSpec(e, profile, fit_coefficients(profile)) for e in EXPERTS],
                     pool(), rate=5.0, limit_s=0.03, seed=9, trace=trace)
        expected = []
        for _ in range(45):  # past the window too
            arrived = sim.arrive()
            expected.append((arrived.arrival, arrived.prompt.id))
            sim.route(0)
        requests = schedule(pool(), texts(), 5.0, 45, seed=9, trace=trace)
        assert [r.prompt.id for r in requests] == [prompt_id for _, prompt_id in expected]
        assert [r.arrival_s for r in requests] == pytest.approx([at for at, _ in expected])
