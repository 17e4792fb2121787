"""DiSCo's race on real vLLM-CPU backends: one small `tiny-llama` labelled the device,
the other small one (same weights) and the large one the server side. Whichever leg
wins, the client gets the greedy answer of the model; the loser is aborted in vLLM."""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson
import pytest

from bench.harness.proxy_process import running_proxy
from proxy.fleet.vllm_metrics import parse_samples

pytestmark = pytest.mark.vllm

SMALL = "tiny-llama"
RACES = 4
BODY = {"model": SMALL, "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 300, "temperature": 0, "ignore_eos": True}
# (long: a tiny model on CPU writes a short answer before the abort of its loser lands)


def disco_config(fleet: Any) -> dict[str, Any]:
    sides = {"small-0": "device"}  # the others: server (the large one serves another model)
    return {
        "backends": [{"name": b.name, "url": b.url, "model": b.model,
                      "labels": {"side": sides.get(b.name, "server")}} for b in fleet],
        # DiSCo-S (the server constrained): the device leads; at budget 1 (the header)
        # Algorithm 3 races every prompt, the server at once
        "policy": {"name": "disco", "params": {
            "mode": "server", "budget": 0.0, "migration": False,
            "recompute_interval_s": 0.05}},
    }


def samples(url: str) -> dict[str, float]:
    return parse_samples(httpx.get(f"{url}/metrics", timeout=5).text)


def finished(url: str) -> float:
    """Requests vLLM finished (stop or length; an abort is not a success)."""
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("vllm:request_success_total{")
               and 'finished_reason="abort"' not in line)


def idle(url: str) -> bool:
    stats = samples(url)
    return stats.get("vllm:num_requests_running", 0.0) + \
        stats.get("vllm:num_requests_waiting", 0.0) == 0.0


def text_of(stream: str) -> str:
    parts = []
    for line in stream.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in orjson.loads(line[6:]).get("choices", ()):
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def test_the_race_answers_the_greedy_text_and_aborts_the_loser(vllm_fleet: Any) -> None:
    urls = {b.name: b.url for b in vllm_fleet if b.model == SMALL}
    assert set(urls) == {"small-0", "small-1"}
    reference = httpx.post(f"{urls['small-0']}/v1/chat/completions", timeout=60,
                           json=BODY).json()["choices"][0]["message"]["content"]
    with running_proxy(disco_config(vllm_fleet)) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=60) as http:
        alone = http.post("/v1/chat/completions", json=BODY)  # budget 0: no race
        assert alone.headers["x-laneway-backend"] == "small-0"
        time.sleep(0.3)  # the background recompute learns p(l) from it
        before = {name: finished(url) for name, url in urls.items()}
        winners, texts = [], []
        for _ in range(RACES):
            answer = http.post("/v1/chat/completions", headers={"x-laneway-budget": "1"},
                               json={**BODY, "stream": True})
            assert answer.status_code == 200
            winners.append(answer.headers["x-laneway-backend"])
            texts.append(text_of(answer.text))
        deadline = time.monotonic() + 30
        while not all(idle(url) for url in urls.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        after = {name: finished(url) for name, url in urls.items()}
        metrics = http.get("/metrics").text
        # not streamed: the first whole answer wins (the loser may have finished too)
        whole = http.post("/v1/chat/completions", headers={"x-laneway-budget": "1"},
                          json=BODY)
    assert alone.json()["choices"][0]["message"]["content"] == reference
    assert texts == [reference] * RACES, winners  # whichever side won
    assert whole.json()["choices"][0]["message"]["content"] == reference
    assert set(winners) <= {"small-0", "small-1"}
    assert all(idle(url) for url in urls.values())
    # 2 legs per race, each opened (hedge at 0): only the winners finished in vLLM
    assert sum(after.values()) - sum(before.values()) == RACES
    wins = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith('laneway_race_wins_total{hedge_opened="yes"'))
    assert wins == RACES
    assert 'laneway_side_decisions_total{first="device",hedge="server",policy="disco"} ' \
        f'{RACES}.0' in metrics
