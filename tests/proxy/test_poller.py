from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from proxy.config import PollerConfig
from proxy.poller import Poller
from proxy.registry import Registry
from proxy.types import Backend


class MetricsServer:
    """A /metrics endpoint whose answer the test controls."""

    def __init__(self) -> None:
        self.running = 2
        self.up = True

    async def metrics(self, _: web.Request) -> web.Response:
        if not self.up:
            return web.Response(status=503)
        return web.Response(text=f'vllm:num_requests_running{{engine="0"}} {self.running}\n')


@pytest.fixture
async def server() -> AsyncIterator[tuple[MetricsServer, str]]:
    state = MetricsServer()
    app = web.Application()
    app.router.add_get("/metrics", state.metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield state, f"http://127.0.0.1:{port}"
    await runner.cleanup()


CFG = PollerConfig(interval_s=0.01, timeout_s=0.5, unhealthy_after=2,
                   backoff_initial_s=0.05, backoff_max_s=0.2)


async def test_scrape_marks_healthy_and_reads_load(server: tuple[MetricsServer, str]) -> None:
    _, url = server
    registry = Registry([Backend("a", url, "m"), Backend("dead", "http://127.0.0.1:9", "m")])
    async with aiohttp.ClientSession() as session:
        poller = Poller(registry, CFG, session)
        await poller.poll_once()
    assert registry.stats["a"].healthy and registry.stats["a"].running == 2
    assert not registry.stats["dead"].healthy
    assert [b.name for b in registry.view("m", 0.0).candidates] == ["a"]


async def test_unhealthy_after_consecutive_failures_then_recovers(
    server: tuple[MetricsServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    state, url = server
    registry = Registry([Backend("a", url, "m")])
    clock = [100.0]
    monkeypatch.setattr("proxy.poller.time.monotonic", lambda: clock[0])
    async with aiohttp.ClientSession() as session:
        poller = Poller(registry, CFG, session)
        await poller.poll_once()
        state.up = False
        await poller.poll_once()
        assert registry.stats["a"].healthy  # one miss is tolerated
        await poller.poll_once()
        assert not registry.stats["a"].healthy
        state.up = True
        await poller.poll_once()  # inside the backoff window: not probed yet
        assert not registry.stats["a"].healthy
        clock[0] += CFG.backoff_initial_s
        await poller.poll_once()
        assert registry.stats["a"].healthy


async def test_relay_failure_takes_backend_out_at_once(
    server: tuple[MetricsServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = server
    registry = Registry([Backend("a", url, "m")])
    clock = [0.0]
    monkeypatch.setattr("proxy.poller.time.monotonic", lambda: clock[0])
    async with aiohttp.ClientSession() as session:
        poller = Poller(registry, CFG, session)
        await poller.poll_once()
        poller.report_failure("a", "connect")
        assert not registry.stats["a"].healthy
        await poller.poll_once()
        assert not registry.stats["a"].healthy  # backoff not elapsed
        clock[0] += 1.0
        await poller.poll_once()
        assert registry.stats["a"].healthy


async def test_backoff_grows_and_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = Registry([Backend("dead", "http://127.0.0.1:9", "m")])
    clock = [0.0]
    monkeypatch.setattr("proxy.poller.time.monotonic", lambda: clock[0])
    async with aiohttp.ClientSession() as session:
        poller = Poller(registry, CFG, session)
        delays = []
        for _ in range(6):
            await poller.poll_once()
            delays.append(poller._health["dead"].backoff_s)
            clock[0] = poller._health["dead"].next_probe_at
    assert delays == [0.05, 0.1, 0.2, 0.2, 0.2, 0.2]
