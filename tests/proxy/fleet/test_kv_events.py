"""proxy/fleet/kv_events.py against a fake vLLM publisher: real ZMQ sockets on
loopback, numbered batches, a replay ROUTER that answers like vLLM's
(vllm/distributed/kv_events.py:509-527), and batches the test "loses" on purpose."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from proxy.fleet.kv_events import KvEventSource, KvEventSubscriber, rank_sources
from proxy.fleet.kv_index import KvIndex

TOPIC = b"kv"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def stored(*hashes: int, parent: int | None = None) -> dict[str, Any]:
    """A BlockStored map as vLLM encodes it (the fields without defaults are always
    there)."""
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": [1] * 16 * len(hashes), "block_size": 16, "lora_id": None,
            "medium": "GPU", "lora_name": None, "group_idx": 0}


def removed(*hashes: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU",
            "group_idx": 0}


class FakePublisher:
    """vLLM's ZmqEventPublisher, in the test's hands: `publish(..., live=False)` buffers a
    batch for replay without sending it, as if the subscriber had missed it."""

    def __init__(self, context: zmq.asyncio.Context, replay: bool = True) -> None:
        self.pub = context.socket(zmq.XPUB)  # XPUB: shows when the subscriber is in
        # every (un)subscription, not only a topic's first and last: a replaced
        # subscriber's close and its successor's subscribe may cross in ZMQ's I/O thread
        self.pub.setsockopt(zmq.XPUB_VERBOSER, 1)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router = context.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:0")
        self.replay = replay
        self.buffer: list[tuple[int, bytes]] = []
        self._server = asyncio.create_task(self._serve_replay())

    @property
    def endpoint(self) -> str:
        return str(self.pub.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def replay_endpoint(self) -> str | None:
        return str(self.router.getsockopt_string(zmq.LAST_ENDPOINT)) if self.replay else None

    async def subscribed(self) -> None:
        assert (await self.pub.recv_multipart()) == [b"\x01" + TOPIC]

    async def publish(self, seq: int, events: list[dict[str, Any]], live: bool = True,
                      ts: float | None = None) -> None:
        payload = msgspec.msgpack.encode([time.time() if ts is None else ts, events, 0])
        self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])

    def restart(self) -> None:
        self.buffer.clear()

    def reopen(self, context: zmq.asyncio.Context) -> None:
        """A new PUB socket on the same port: the old connection drops."""
        endpoint = self.endpoint
        self.pub.close(linger=0)
        self.pub = context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSER, 1)
        for _ in range(100):  # the closed socket's port is released asynchronously
            try:
                self.pub.bind(endpoint)
                return
            except zmq.ZMQError:
                time.sleep(0.02)
        self.pub.bind(endpoint)

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            for seq, payload in list(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart(
                        [client, b"", TOPIC, seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        self._server.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._server
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)  # also the sockets a failed test left open


async def until(condition: Callable[[], bool]) -> None:
    """Wait for the subscriber to get somewhere (the assertions follow, on state)."""
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in 5 s")


async def subscribed(context: zmq.asyncio.Context, index: KvIndex, replay: bool = True
                     ) -> tuple[FakePublisher, KvEventSubscriber]:
    publisher = FakePublisher(context, replay)
    subscriber = KvEventSubscriber(
        KvEventSource("a", publisher.endpoint, publisher.replay_endpoint, topic="kv"),
        index, context)
    await subscriber.start()
    await publisher.subscribed()
    return publisher, subscriber


async def test_live_events_feed_the_index(context: zmq.asyncio.Context) -> None:
    index = KvIndex()
    publisher, subscriber = await subscribed(context, index)
    await publisher.publish(0, [stored(1, 2, 3)])
    await publisher.publish(1, [stored(4, parent=3), stored(1), removed(2),
                                {"type": "BlockMoved", "block_hashes": [9]}])
    await until(lambda: subscriber.next_seq == 2)
    assert index.longest_prefix("a", [1, 2, 3, 4]) == 1
    assert index.copies("a", 0, 1) == 2
    assert (subscriber.batches, subscriber.events, subscriber.unknown_events) == (2, 4, 1)
    assert (subscriber.gaps, subscriber.replays, subscriber.resyncs) == (0, 0, 0)
    await publisher.pub.send_multipart([TOPIC + b"2", (2).to_bytes(8, "big"),
                                        msgspec.msgpack.encode([1.0, [stored(8)], 0])])
    await publisher.publish(2, [{"type": "AllBlocksCleared"}])
    await until(lambda: subscriber.next_seq == 3)
    assert index.size("a") == 0  # cleared, and topic "kv2" was not ours
    assert subscriber.restarts == 0 and subscriber.batches == 3
    await subscriber.stop()
    await publisher.close()


async def test_gap_is_filled_by_replay(context: zmq.asyncio.Context) -> None:
    index = KvIndex()
    publisher, subscriber = await subscribed(context, index)
    await publisher.publish(0, [stored(1, 2)])
    await publisher.publish(1, [stored(3, parent=2)], live=False)  # lost on the way
    await publisher.publish(2, [removed(1)], live=False)
    await publisher.publish(3, [stored(1)])
    await until(lambda: subscriber.next_seq == 4)
    assert index.longest_prefix("a", [1, 2, 3]) == 3  # the removal was replayed too
    assert index.copies("a", 0, 1) == 1
    assert (subscriber.gaps, subscriber.replays, subscriber.resyncs) == (1, 1, 0)
    assert subscriber.batches == 4
    await subscriber.stop()
    await publisher.close()


async def test_restart_drops_the_old_cache(context: zmq.asyncio.Context) -> None:
    index = KvIndex()
    publisher, subscriber = await subscribed(context, index)
    await publisher.publish(0, [stored(1, 2)])
    await publisher.publish(1, [stored(3, parent=2)])
    await until(lambda: subscriber.next_seq == 2)
    publisher.restart()  # the server restarts: an empty cache, numbering from 0 again
    await publisher.publish(0, [stored(7)])
    await until(lambda: subscriber.restarts == 1 and subscriber.next_seq == 1)
    assert index.longest_prefix("a", [1, 2, 3]) == 0
    assert index.longest_prefix("a", [7]) == 1
    await subscriber.stop()
    await publisher.close()


async def test_gap_across_a_restart_is_a_resync(context: zmq.asyncio.Context) -> None:
    """The live numbers still rise (1, then 3) but the server restarted in between:
    the batch the replay returns for 1 is not the one applied (its timestamp differs)."""
    index = KvIndex()
    publisher, subscriber = await subscribed(context, index)
    await publisher.publish(0, [stored(1, 2)], ts=100.0)
    await publisher.publish(1, [stored(3, parent=2)], ts=101.0)
    await until(lambda: subscriber.next_seq == 2)
    publisher.restart()
    for seq in range(3):
        await publisher.publish(seq, [stored(10 + seq)], live=False, ts=200.0 + seq)
    await publisher.publish(3, [stored(13)], ts=203.0)
    await until(lambda: subscriber.next_seq == 4)
    assert index.longest_prefix("a", [1, 2, 3]) == 0
    assert all(index.copies("a", 0, h) == 1 for h in (10, 11, 12, 13))
    assert (subscriber.gaps, subscriber.resyncs, subscriber.restarts) == (1, 1, 0)
    await subscriber.stop()
    await publisher.close()


async def test_restart_behind_a_dropped_connection(context: zmq.asyncio.Context) -> None:
    """The server restarts while we are disconnected and numbers exactly up to where we
    were: no gap, no backwards step; the dropped connection makes the check happen."""
    index = KvIndex()
    publisher, subscriber = await subscribed(context, index)
    await publisher.publish(0, [stored(1, 2)], ts=100.0)
    await publisher.publish(1, [stored(3, parent=2)], ts=101.0)
    await until(lambda: subscriber.next_seq == 2)
    publisher.restart()
    publisher.reopen(context)
    await until(lambda: subscriber.disconnects == 1)
    await publisher.subscribed()
    await publisher.publish(0, [stored(10)], live=False, ts=200.0)
    await publisher.publish(1, [stored(11)], live=False, ts=201.0)
    await publisher.publish(2, [stored(12)], ts=202.0)
    await until(lambda: subscriber.next_seq == 3 and subscriber.resyncs == 1)
    assert index.longest_prefix("a", [1, 2, 3]) == 0
    assert all(index.copies("a", 0, h) == 1 for h in (10, 11, 12))
    assert (subscriber.gaps, subscriber.restarts) == (0, 0)
    await subscriber.stop()
    await publisher.close()


async def test_gap_past_the_replay_buffer_is_a_resync(context: zmq.asyncio.Context) -> None:
    index = KvIndex()
    publisher, subscriber = await subscribed(context, index)
    await publisher.publish(0, [stored(1, 2)])
    await until(lambda: subscriber.next_seq == 1)
    for seq in range(1, 6):
        await publisher.publish(seq, [removed(1), stored(20 + seq)], live=False)
    del publisher.buffer[:3]  # vLLM kept only its last `buffer_steps` batches: 3 on
    await publisher.publish(6, [stored(30)])
    await until(lambda: subscriber.next_seq == 7)
    # block 1 was removed while unheard: dropped with the rest, not kept stale
    assert index.copies("a", 0, 1) == 0 and index.copies("a", 0, 2) == 0
    assert [index.copies("a", 0, h) for h in (21, 22, 23, 24, 25, 30)] == [0, 0, 1, 1, 1, 1]
    assert (subscriber.gaps, subscriber.resyncs) == (1, 1)
    await subscriber.stop()
    await publisher.close()


async def test_gap_without_replay_endpoint_is_a_resync(context: zmq.asyncio.Context) -> None:
    index = KvIndex()
    publisher, subscriber = await subscribed(context, index, replay=False)
    await publisher.publish(0, [stored(1, 2)])
    await publisher.publish(1, [removed(1)], live=False)
    await publisher.publish(2, [stored(5)])
    await until(lambda: subscriber.next_seq == 3)
    assert index.copies("a", 0, 1) == 0 and index.copies("a", 0, 2) == 0
    assert index.copies("a", 0, 5) == 1
    assert (subscriber.gaps, subscriber.replays, subscriber.resyncs) == (1, 0, 1)
    await subscriber.stop()
    await publisher.close()


async def test_a_late_subscriber_replays_the_buffer(context: zmq.asyncio.Context) -> None:
    index = KvIndex()
    publisher = FakePublisher(context)
    for seq in range(3):  # before anyone listened
        await publisher.publish(seq, [stored(seq + 1, parent=seq or None)], live=False)
    async with KvEventSubscriber(
            KvEventSource("a", publisher.endpoint, publisher.replay_endpoint, topic="kv"),
            index, context) as subscriber:
        await publisher.subscribed()
        await publisher.publish(3, [stored(4, parent=3)])
        await until(lambda: subscriber.next_seq == 4)
        assert index.longest_prefix("a", [1, 2, 3, 4]) == 4
        assert (subscriber.gaps, subscriber.replays, subscriber.resyncs) == (0, 1, 0)
    await publisher.close()


async def test_bind_mode_and_malformed_messages() -> None:
    """vLLM with a `tcp://host:port` endpoint connects to us: the subscriber binds."""
    index = KvIndex()
    async with KvEventSubscriber(KvEventSource("a", "tcp://127.0.0.1:0", bind=True),
                                 index) as subscriber:
        assert subscriber._sub is not None
        endpoint = subscriber._sub.getsockopt_string(zmq.LAST_ENDPOINT)
        context = zmq.asyncio.Context()
        pub = context.socket(zmq.XPUB)
        pub.connect(str(endpoint))
        assert (await pub.recv_multipart()) == [b"\x01"]  # subscribed to every topic
        batch = msgspec.msgpack.encode([1.0, [stored(1)], 0])
        await pub.send_multipart([b"", (0).to_bytes(8, "big"), batch])
        await until(lambda: subscriber.next_seq == 1)
        assert index.copies("a", 0, 1) == 1
        await pub.send_multipart([b"", (1).to_bytes(4, "big"), batch])  # a 4-byte seq
        await pub.send_multipart([b"", (1).to_bytes(8, "big"), b"\xc1"])  # not msgpack
        await until(lambda: subscriber.decode_errors == 2)
        assert index.size("a") == 0  # the lost batch made the rank's blocks doubtful
        assert subscriber.next_seq == 2 and subscriber.resyncs == 0
        pub.close(linger=0)
        context.term()
    assert subscriber._tasks == []


def test_rank_sources_offset_the_ports() -> None:
    source = KvEventSource("a", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", topic="kv")
    ranks = rank_sources(source, 3)
    assert [(s.rank, s.endpoint, s.replay_endpoint) for s in ranks] == [
        (0, "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558"),
        (1, "tcp://10.0.0.5:5558", "tcp://10.0.0.5:5559"),
        (2, "tcp://10.0.0.5:5559", "tcp://10.0.0.5:5560")]
    assert all(s.topic == "kv" and s.backend == "a" for s in ranks)
    assert rank_sources(KvEventSource("a", "tcp://h:5557"), 2)[1].replay_endpoint is None



async def test_a_bound_socket_refuses_an_oversized_message() -> None:
    """Whoever reaches a socket the proxy binds cannot make it take in an unbounded
    message: ZMQ drops that connection past MAX_MESSAGE_BYTES before reading it, the
    sender may connect again, and later batches are read as usual."""
    from proxy.fleet.kv_events import MAX_MESSAGE_BYTES

    index = KvIndex()
    async with KvEventSubscriber(KvEventSource("a", "tcp://127.0.0.1:0", bind=True),
                                 index) as subscriber:
        assert subscriber._sub is not None
        endpoint = str(subscriber._sub.getsockopt_string(zmq.LAST_ENDPOINT))
        context = zmq.asyncio.Context()
        pub = context.socket(zmq.XPUB)
        pub.setsockopt(zmq.XPUB_VERBOSER, 1)
        pub.connect(endpoint)
        assert (await pub.recv_multipart()) == [b"\x01"]
        huge = stored(1)
        huge["token_ids"] = [1] * (MAX_MESSAGE_BYTES + 1)  # a byte a token in msgpack
        await pub.send_multipart([b"", (0).to_bytes(8, "big"),
                                  msgspec.msgpack.encode([1.0, [huge], 0])])
        # dropped, and the connecting side's reconnection subscribes again (its
        # unsubscription, if any, may come first)
        heard = [await asyncio.wait_for(pub.recv_multipart(), 5.0)]
        if heard[0] == [b"\x00"]:
            heard.append(await asyncio.wait_for(pub.recv_multipart(), 5.0))
        assert heard[-1] == [b"\x01"]
        await pub.send_multipart([b"", (0).to_bytes(8, "big"),
                                  msgspec.msgpack.encode([1.0, [stored(2)], 0])])
        await until(lambda: subscriber.next_seq == 1)
        assert index.size("a") == 1 and index.copies("a", 0, 1) == 0
        pub.close(linger=0)
        context.term()
