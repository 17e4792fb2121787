"""`python -m bench workload|run|solo` end to end, over fake vLLM processes and the proxy."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from bench.__main__ import main
from bench.harness.ports import free_port
from bench.harness.results import read
from bench.harness.workloads import load

SMALL = ["--requests", "6", "--rate", "20", "--max-output", "12", "--seed", "3",
         "--no-progress"]


@contextlib.contextmanager
def fake_process(model: str = "tiny-llama") -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.fakes.fake_vllm", "--port", str(port),
                             "--model", model, "--tpot-ms", "2"])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline and proc.poll() is None, "fake did not start"
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_workload_command_saves_and_describes(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "w.jsonl"
    assert main(["workload", "--workload", "trace", "--requests", "50",
                 "--time-scale", "0.1", "--out", str(out)]) == 0
    assert load(out).meta["kind"] == "trace" and len(load(out).requests) == 50
    assert "50 requests over" in capsys.readouterr().out


def test_run_starts_a_proxy_with_the_policy_and_solo_repeats(tmp_path: Path) -> None:
    workload = tmp_path / "w.jsonl"
    assert main(["workload", "--workload", "poisson", *SMALL[:-1],
                 "--out", str(workload)]) == 0
    with fake_process() as fake:  # behind two backend names: the policy must alternate
        config = {"backends": [{"name": "fa", "url": fake, "model": "tiny-llama"},
                               {"name": "fb", "url": fake, "model": "tiny-llama"}],
                  "policy": {"name": "random", "params": {}},
                  "debug": {"log_decisions": True}}
        (tmp_path / "laneway.yaml").write_text(yaml.safe_dump(config))
        assert main(["run", "--workload", str(workload), "--no-progress",
                     "--config", str(tmp_path / "laneway.yaml"), "--policy", "round_robin",
                     "--out", str(tmp_path / "rr.jsonl"),
                     "--proxy-log", str(tmp_path / "rr.log")]) == 0
        assert main(["solo", "--workload", "poisson", *SMALL, "--target", fake,
                     "--repeats", "2", "--max-requests", "4",
                     "--out", str(tmp_path / "solo.jsonl")]) == 0
    run = read(tmp_path / "rr.jsonl")
    assert run.header["policy"] == "round_robin" and run.name == "round_robin"
    assert len(run.results) == 6 and all(r.ok for r in run.results)
    assert sorted(r.backend or "" for r in run.results) == ["fa"] * 3 + ["fb"] * 3
    decisions = [line for line in (tmp_path / "rr.log").read_text().splitlines()
                 if " model=tiny-llama -> " in line]  # the proxy's log, kept
    assert len(decisions) == 6 and sum(" -> fa (" in line for line in decisions) == 3
    planned = {r.seq: r.max_tokens for r in load(workload).requests}
    assert all(r.output_tokens == planned[r.seq] for r in run.results)
    solo = read(tmp_path / "solo.jsonl")
    assert solo.header["mode"] == "solo" and len(solo.results) == 8
    assert sorted(r.id for r in solo.results) == sorted(
        [r.id for r in load(workload).requests[:4]] * 2)  # same workload from the same seed
