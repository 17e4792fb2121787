import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from proxy.config import PollerConfig
from proxy.fleet.poller import Poller
from proxy.fleet.registry import Registry
from proxy.fleet.vllm_metrics import WANTED
from proxy.types import Backend


class MetricsServer:
    """A /metrics endpoint whose answer the test controls."""

    def __init__(self) -> None:
        self.running = 2
        self.up = True
        self.hang = False
        self.close = False  # answer with `Connection: close`
        self.queries: list[tuple[str, list[str]]] = []  # (path, name[] values)
        self.peers: set[object] = set()

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        self.queries.append((request.path, request.query.getall("name[]", [])))
        self.peers.add(request.transport.get_extra_info("peername")  # type: ignore[union-attr]
                       if request.transport else None)
        if self.hang:
            await asyncio.sleep(60)
        if not self.up:
            return web.Response(status=503)
        response = web.Response(
            text=f'vllm:num_requests_running{{engine="0"}} {self.running}\n'
                 'vllm:num_requests_waiting{engine="0"} 1\n')
        if self.close:
            response.force_close()
        return response


@pytest.fixture
async def server() -> AsyncIterator[tuple[MetricsServer, str]]:
    async with serving(MetricsServer()) as served:
        yield served


class serving:
    def __init__(self, state: MetricsServer, filtered_page: bool = True) -> None:
        self.state = state
        app = web.Application()
        app.router.add_get("/metrics", state.metrics)
        if filtered_page:  # like vLLM: prometheus_client's app at /metrics/
            app.router.add_get("/metrics/", state.metrics)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)

    async def __aenter__(self) -> tuple[MetricsServer, str]:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.state, f"http://127.0.0.1:{port}"

    async def __aexit__(self, *_: object) -> None:
        await self.runner.cleanup()


CFG = PollerConfig(interval_s=0.01, timeout_s=0.5, unhealthy_after=2,
                   backoff_initial_s=0.05, backoff_max_s=0.2)


@pytest.fixture
async def make_poller() -> AsyncIterator[Callable[[Registry, PollerConfig], Poller]]:
    made: list[Poller] = []

    def make(registry: Registry, cfg: PollerConfig = CFG) -> Poller:
        made.append(Poller(registry, cfg))
        return made[-1]

    yield make
    for poller in made:
        await poller.scraper.close()


Make = Callable[..., Poller]


async def test_scrape_marks_healthy_and_reads_load(
    server: tuple[MetricsServer, str], make_poller: Make
) -> None:
    _, url = server
    registry = Registry([Backend("a", url, "m"), Backend("dead", "http://127.0.0.1:9", "m")])
    await make_poller(registry).poll_once()
    assert registry.stats["a"].healthy and registry.stats["a"].running == 2
    assert registry.stats["a"].waiting == 1
    assert not registry.stats["dead"].healthy
    assert [b.name for b in registry.view("m", 0.0).candidates] == ["a"]


async def test_asks_for_the_samples_it_reads_over_one_kept_connection(
    server: tuple[MetricsServer, str], make_poller: Make
) -> None:
    state, url = server
    registry = Registry([Backend("a", url, "m")])
    poller = make_poller(registry)
    for _ in range(5):
        await poller.poll_once()
    assert state.queries == [("/metrics/", list(WANTED))] * 5
    assert "vllm:num_requests_running" in WANTED
    assert len(state.peers) == 1  # keep-alive: the same client socket every time

    unfiltered = make_poller(Registry([Backend("a", url, "m")]),
                             CFG.model_copy(update={"filter_families": False}))
    await unfiltered.poll_once()
    assert state.queries[-1] == ("/metrics", [])


async def test_a_server_without_the_filtered_page_is_read_whole(make_poller: Make) -> None:
    async with serving(MetricsServer(), filtered_page=False) as (state, url):
        registry = Registry([Backend("a", url, "m")])
        poller = make_poller(registry)
        for _ in range(3):
            await poller.poll_once()
            assert registry.stats["a"].healthy and registry.stats["a"].running == 2
    # /metrics/ answered 404 once (not counted: aiohttp routes it away), then /metrics
    assert state.queries == [("/metrics", [])] * 3
    assert poller._health["a"].failures == 0


async def test_unhealthy_after_consecutive_failures_then_recovers(
    server: tuple[MetricsServer, str], monkeypatch: pytest.MonkeyPatch, make_poller: Make
) -> None:
    state, url = server
    registry = Registry([Backend("a", url, "m")])
    clock = [100.0]
    monkeypatch.setattr("proxy.fleet.poller.time.monotonic", lambda: clock[0])
    poller = make_poller(registry)
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
    server: tuple[MetricsServer, str], monkeypatch: pytest.MonkeyPatch, make_poller: Make
) -> None:
    _, url = server
    registry = Registry([Backend("a", url, "m")])
    clock = [0.0]
    monkeypatch.setattr("proxy.fleet.poller.time.monotonic", lambda: clock[0])
    poller = make_poller(registry)
    await poller.poll_once()
    poller.report_failure("a", "connect")
    assert not registry.stats["a"].healthy
    await poller.poll_once()
    assert not registry.stats["a"].healthy  # backoff not elapsed
    clock[0] += 1.0
    await poller.poll_once()
    assert registry.stats["a"].healthy


async def test_backoff_grows_and_is_capped(
    monkeypatch: pytest.MonkeyPatch, make_poller: Make
) -> None:
    registry = Registry([Backend("dead", "http://127.0.0.1:9", "m")])
    clock = [0.0]
    monkeypatch.setattr("proxy.fleet.poller.time.monotonic", lambda: clock[0])
    poller = make_poller(registry)
    delays = []
    for _ in range(6):
        await poller.poll_once()
        delays.append(poller._health["dead"].backoff_s)
        clock[0] = poller._health["dead"].next_probe_at
    assert delays == [0.05, 0.1, 0.2, 0.2, 0.2, 0.2]


async def test_a_hung_backend_delays_no_one_else(make_poller: Make) -> None:
    async with serving(MetricsServer()) as (_, fast_url), \
            serving(MetricsServer()) as (hung, hung_url):
        hung.hang = True
        registry = Registry([Backend("fast", fast_url, "m"), Backend("hung", hung_url, "m")])
        poller = make_poller(registry, CFG.model_copy(update={"timeout_s": 1.0}))
        task = asyncio.create_task(poller.run())
        updates = []
        try:
            for _ in range(20):  # ~0.2 s, well inside the hung scrape's timeout
                await asyncio.sleep(0.01)
                if "fast" in registry.stats:
                    updates.append(registry.stats["fast"].updated_at)
            assert len(set(updates)) >= 5  # the fast one kept being published
            assert "hung" not in registry.stats  # its first scrape is still out
            for _ in range(600):  # two timeouts (unhealthy_after = 2): ~2 s
                if "hung" in registry.stats and not registry.stats["hung"].healthy:
                    break
                await asyncio.sleep(0.01)
            assert not registry.stats["hung"].healthy and registry.stats["fast"].healthy
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


async def test_server_closing_the_connection_and_timeouts_are_survived(
    make_poller: Make
) -> None:
    async with serving(MetricsServer()) as (state, url):
        registry = Registry([Backend("a", url, "m")])
        poller = make_poller(registry, CFG.model_copy(update={"timeout_s": 0.1}))
        state.close = True
        for running in (3, 4):  # a new connection after each close
            state.running = running
            await poller.poll_once()
            assert registry.stats["a"].running == running
        assert len(state.peers) == 2
        state.close = False
        state.hang = True
        await poller.poll_once()  # timed out: the connection is dropped
        assert poller._health["a"].failures == 1
        state.hang = False
        state.running = 7
        await poller.poll_once()  # a new connection
        assert registry.stats["a"].running == 7 and poller._health["a"].failures == 0
        assert len(state.peers) == 4  # 2 closed by the server, 1 dropped on timeout, 1 new


async def test_two_backends_at_one_url_are_scraped_side_by_side(
    server: tuple[MetricsServer, str], make_poller: Make
) -> None:
    """E.g. one vLLM server registered twice (prefill and decode roles)."""
    state, url = server
    registry = Registry([Backend("prefill", url, "m"), Backend("decode", url, "m")])
    poller = make_poller(registry)
    for _ in range(3):
        await poller.poll_once()
        assert registry.stats["prefill"].healthy and registry.stats["decode"].healthy
    assert poller._health["prefill"].failures == poller._health["decode"].failures == 0
    assert len(state.peers) == 2  # a connection each, kept
