"""Strict flow control (`flow_control.strict`) on a real Redis: two replicas in front
of one backend never hold more than the limit on it together, at any moment."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from bench.fakes.fake_vllm import FakeConfig, serve_fake
from bench.harness.ports import free_port
from proxy.config import Settings
from proxy.http.server import serve_in_loop
from tests.proxy.fakes import CHAT, post

LIMIT = 3


async def _peak_through_two_replicas(redis_url: str, strict: bool
                                     ) -> tuple[int, list[int], str]:
    """(the backend's peak of open requests, the answers' statuses, the first replica's
    metrics) under bursts sent through both replicas at once."""
    async with contextlib.AsyncExitStack() as stack:
        fake = await stack.enter_async_context(serve_fake(FakeConfig(tpot_s=0.01)))
        settings = _settings(fake.url, {"strict": strict}, {"redis_url": redis_url})
        replicas = [await stack.enter_async_context(serve_in_loop(settings))
                    for _ in range(2)]
        statuses: list[int] = []
        for burst in range(3):
            await asyncio.sleep(0.2)  # the leases settle (idle: an equal part each)
            answers = await asyncio.gather(*(
                post(proxy, _chat(f"{burst}-{i}")) for i in range(8) for proxy in replicas))
            statuses += [a.status_code for a in answers]
        runtime = replicas[0].app.runtime
        assert runtime is not None
        return fake.app.stats.peak, statuses, runtime.metrics.render().decode()


def _settings(fake_url: str, flow_control: dict[str, Any], state: dict[str, Any]
              ) -> Settings:
    """One replica in front of the fake `f0`, at LIMIT open requests, on Redis state."""
    return Settings.model_validate({
        "server": {"port": 0}, "policy": {"name": "round_robin"},
        "backends": [{"name": "f0", "url": fake_url, "model": "fake"}],
        "flow_control": {"max_inflight_per_backend": LIMIT, **flow_control},
        "state": {"backend": "redis", **state}})


def _chat(text: str) -> dict[str, Any]:
    return {**CHAT, "messages": [{"role": "user", "content": text}], "max_tokens": 4}


async def test_strict_replicas_never_hold_more_than_the_limit_together(
        redis_url: str) -> None:
    peak, statuses, metrics = await _peak_through_two_replicas(redis_url, strict=True)
    assert statuses == [200] * 48
    assert peak == LIMIT  # reached, never passed (without strict: 2 x LIMIT, checked)
    assert 'laneway_flow_leased_slots{backend="f0"}' in metrics


async def test_a_replica_started_without_redis_serves_within_the_limit() -> None:
    """Nothing listens at `redis_url`: the replica never leased, so it has nothing to
    wait out (inflight_ttl_s) and takes the whole limit at once, as a lone replica."""
    async with contextlib.AsyncExitStack() as stack:
        fake = await stack.enter_async_context(serve_fake(FakeConfig(tpot_s=0.01)))
        settings = _settings(fake.url, {"queue_timeout_s": 2.0}, {
            "inflight_ttl_s": 600.0, "timeout_s": 0.2,
            "redis_url": f"redis://127.0.0.1:{free_port()}/0"})
        proxy = await stack.enter_async_context(serve_in_loop(settings))
        answers = await asyncio.gather(*(post(proxy, _chat(f"{i}")) for i in range(8)))
    assert [a.status_code for a in answers] == [200] * 8  # before: 503 after 2 s
    assert fake.app.stats.peak == LIMIT
