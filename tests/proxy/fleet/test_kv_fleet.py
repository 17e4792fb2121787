"""The runtime's KV events (proxy/fleet/kv_fleet.py) through a config reload: a backend
added with `kv_events` is followed from then on (a fake vLLM publisher on real ZMQ
sockets, tests/proxy/fleet/test_kv_events.py), one removed or replaced stops being followed
and its blocks leave the index; the counters reach /metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from proxy.config import KvEventsConfig, Settings
from proxy.fleet.kv_fleet import KvFleet
from proxy.reconfigure import apply_settings
from proxy.runtime import Runtime
from tests.proxy.fleet.test_kv_events import TOPIC, FakePublisher, stored, until


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


def _settings(*backends: dict[str, Any]) -> Settings:
    return Settings.model_validate({
        "backends": [{"name": "plain", "url": "http://127.0.0.1:9", "model": "m"}, *backends],
        "policy": {"name": "kv_aware"}})


def _followed(publisher: FakePublisher, **more: Any) -> dict[str, Any]:
    return {"name": "cached", "url": "http://127.0.0.1:9", "model": "m",
            "kv_events": {"endpoint": publisher.endpoint,
                          "replay_endpoint": publisher.replay_endpoint, "topic": "kv",
                          **more}}


async def _unsubscribed(publisher: FakePublisher) -> None:
    """XPUB hears the subscriber's socket close as an unsubscription."""
    message = await asyncio.wait_for(publisher.pub.recv_multipart(), 5.0)
    assert message == [b"\x00" + TOPIC]


async def _resubscribed(publisher: FakePublisher) -> None:
    """The old subscriber's unsubscription and the new one's subscription, in the order
    ZMQ's I/O thread delivers them (the old socket is closed first, but its
    disconnection can reach the publisher after the new socket's subscription)."""
    messages = [await asyncio.wait_for(publisher.pub.recv_multipart(), 5.0)
                for _ in range(2)]
    assert sorted(messages) == [[b"\x00" + TOPIC], [b"\x01" + TOPIC]]


def _sample(rt: Runtime, name: str) -> str:
    return next(line for line in rt.metrics.render().decode().splitlines()
                if line.startswith(name + '{backend="cached"}'))


async def test_reload_starts_and_stops_a_backends_subscriber(
        context: zmq.asyncio.Context) -> None:
    rt = Runtime(_settings())
    publisher = FakePublisher(context)
    try:
        apply_settings(rt, _settings(_followed(publisher)), rt.router.policy)
        await rt.kv.settled()
        await publisher.subscribed()
        await publisher.publish(0, [stored(1, 2, 3)])
        await until(lambda: rt.kv.index.size("cached") == 3)
        assert rt.kv.index.longest_prefix("cached", [1, 2, 3, 4]) == 3
        assert _sample(rt, "laneway_kv_events_total").endswith(" 1.0")
        assert _sample(rt, "laneway_kv_index_blocks").endswith(" 3.0")
        assert _sample(rt, "laneway_kv_event_gaps_total").endswith(" 0.0")

        # a changed kv_events replaces the backend: a new subscriber, the old blocks gone
        changes = apply_settings(rt, _settings(_followed(publisher, block_size=128)),
                                 rt.router.policy)
        assert changes["replaced"] == ["cached"]
        assert rt.kv.index.size("cached") == 0
        await rt.kv.settled()
        await _resubscribed(publisher)
        cfg = rt.kv.config_of("cached")
        assert cfg is not None and cfg.block_size == 128
        await publisher.publish(1, [stored(7)])  # 0 was heard by the old one: a replay
        await until(lambda: rt.kv.index.size("cached") == 4)

        changes = apply_settings(rt, _settings(), rt.router.policy)
        assert changes["removed"] == ["cached"]
        await rt.kv.settled()
        await _unsubscribed(publisher)
        assert rt.kv.index.size("cached") == 0 and rt.kv.config_of("cached") is None
        assert 'backend="cached"' not in rt.metrics.render().decode()
    finally:
        await rt.close()
        await publisher.close()


async def test_a_backend_without_kv_events_is_not_followed() -> None:
    rt = Runtime(_settings())
    try:
        apply_settings(rt, _settings({"name": "other", "url": "http://127.0.0.1:9",
                                      "model": "m"}), rt.router.policy)
        await rt.kv.settled()
        assert rt.kv.config_of("other") is None and list(rt.kv.counters()) == []
    finally:
        await rt.close()


async def test_the_lifespan_starts_and_closes_the_subscribers(context: zmq.asyncio.Context) -> None:
    publisher = FakePublisher(context)
    rt = Runtime(_settings(_followed(publisher)))
    try:
        await rt.start()  # the lifespan's start (the backends are down: not healthy)
        await rt.kv.settled()
        await publisher.subscribed()
    finally:
        await rt.close()
    await _unsubscribed(publisher)
    assert rt.kv.config_of("cached") is None
    await publisher.close()


async def test_an_endpoint_that_cannot_bind_costs_only_its_events(
        caplog: pytest.LogCaptureFixture) -> None:
    kv = KvFleet()
    kv.add("a", KvEventsConfig(endpoint="tcp://192.0.2.1:5557", bind=True))  # not ours
    await kv.settled()
    assert "not followed" in caplog.text
    assert kv.config_of("a") is not None and kv.index.size("a") == 0
    await kv.close()
    assert kv.config_of("a") is None
