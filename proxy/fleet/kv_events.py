"""One backend's KV cache events, from its ZMQ publisher into the exact index.

vLLM publishes numbered batches on a PUB socket and keeps the last `buffer_steps` of
them for replay on a ROUTER socket (vllm/distributed/kv_events.py:306-527): a request
is an empty frame and an 8-byte big-endian start sequence; the answer is every
buffered batch from there as `("", topic, seq, payload)`, then `("", "", -1, "")`.
The sequence restarts at 0 when the server restarts, the buffer lives in memory
only, and a new subscriber sees nothing published before it connected. So:

* first batch heard, not numbered 0: replay from 0 to learn what the buffer still
  holds (all of it, on a server younger than its buffer);
* a gap: replay from the last batch applied, whose timestamp must match the one we
  applied (the same server, not one restarted since); else drop this rank's blocks
  and rebuild from whatever the buffer holds (a *resync*);
* a sequence number at or below the last one heard live: the server restarted, its
  cache is empty; drop and rebuild the same way;
* batches a replay already applied come again live: skipped;
* the connection dropped (a ZMQ socket monitor): the next batch checks continuity as
  after a gap, even when its number is the one expected.

Without a replay endpoint a gap is a resync from the batch at hand. A dropped rank
only under-counts (a missed hit), while a missed removal would over-count forever,
which is why any doubt drops.

Each data-parallel rank publishes on its own port (endpoint port + rank,
kv_events.py:529-563): one subscriber per rank (`rank_sources`). vLLM binds its endpoint when it has
`*` or `::` in it and connects otherwise (kv_events.py:448-456); `bind=True` is for
the second case: this side binds and vLLM connects to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from types import TracebackType

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from proxy.fleet.kv_index import KvIndex
from proxy.fleet.kv_wire import Decoder

log = logging.getLogger("laneway.kv_events")
# On a socket we bind (anyone on its network may connect), a message past this size
# drops the connection before it is read (ZMQ's MAXMSGSIZE; the sender may reconnect).
# A batch of vLLM's is a few hundred KB for a 100k-token prefill. Not on a socket we
# connect: there the sender is the configured server, and ZMQ would not reconnect
# after such a drop (a protocol error ends the session for good).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class KvEventSource:
    backend: str
    endpoint: str  # tcp://host:port of vLLM's PUB socket (or ours to bind, `bind`)
    replay_endpoint: str | None = None  # tcp://host:port of vLLM's ROUTER socket
    topic: str = ""
    rank: int = 0  # the data-parallel rank this endpoint belongs to
    bind: bool = False
    replay_timeout_s: float = 2.0  # per reply frame; vLLM answers between engine steps


def rank_sources(source: KvEventSource, data_parallel_size: int) -> list[KvEventSource]:
    """One source per data-parallel rank of a backend: rank r publishes (and replays)
    on the configured port + r (vLLM's `offset_endpoint_port`)."""
    return [dataclasses.replace(source, rank=rank,
                                endpoint=_offset_port(source.endpoint, rank),
                                replay_endpoint=source.replay_endpoint
                                and _offset_port(source.replay_endpoint, rank))
            for rank in range(data_parallel_size)]


def _offset_port(endpoint: str, rank: int) -> str:
    address, _, port = endpoint.rpartition(":")
    if rank == 0 or not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{address}:{int(port) + rank}"


class KvEventSubscriber:
    """Feeds `index` from one source; `start()`/`stop()` or `async with`. The counters
    are plain attributes for now (metrics wiring comes with the routing policy)."""

    def __init__(self, source: KvEventSource, index: KvIndex,
                 context: zmq.asyncio.Context | None = None) -> None:
        self.source = source
        self._index = index
        self._own_context = context is None
        self._context = context or zmq.asyncio.Context()
        self._decoder = Decoder()
        self._sub: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._suspect = False  # the connection dropped: the server may have restarted
        self._next: int | None = None  # the next sequence number to apply
        self._last_ts: float | None = None  # the timestamp of the batch before it
        self._last_live: int | None = None  # the last number heard on the PUB socket
        self._ranks: set[int] = {source.rank}
        self.batches = 0  # batches applied, live or replayed
        self.events = 0  # events applied
        self.unknown_events = 0  # of a type this version does not know: skipped
        self.decode_errors = 0  # malformed messages or payloads
        self.gaps = 0  # live numbers past the next expected one
        self.replays = 0  # replay requests sent
        self.resyncs = 0  # times this rank's blocks were dropped and rebuilt
        self.restarts = 0  # sequence restarts seen (a restarted server)
        self.disconnects = 0  # connections to the publisher lost

    @property
    def next_seq(self) -> int | None:
        return self._next

    async def start(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        if self.source.bind:
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        try:
            if self.source.bind:
                sub.bind(self.source.endpoint)
            else:
                sub.connect(self.source.endpoint)
        except zmq.ZMQError:
            sub.close(linger=0)  # an open socket would hang stop()'s context.term()
            raise
        self._sub = sub
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        name = f"kv-events {self.source.backend} rank {self.source.rank}"
        self._tasks = [asyncio.create_task(self._run(), name=name),
                       asyncio.create_task(self._watch(monitor), name=f"{name} monitor")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._sub is not None:
            self._sub.disable_monitor()
            self._sub.close(linger=0)
            self._sub = None
        if self._own_context and not self._context.closed:
            self._context.term()

    async def __aenter__(self) -> KvEventSubscriber:
        await self.start()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        await self.stop()

    async def _run(self) -> None:
        assert self._sub is not None
        while True:
            frames = await self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.decode_errors += 1
                continue
            if frames[0] != self.source.topic.encode():
                continue  # ZMQ filters by prefix: "kv" also lets "kv2" through
            try:
                await self._on_live(int.from_bytes(frames[1], "big"), frames[2])
            except zmq.ZMQError:  # the replay socket failed: the state is unsure
                log.exception("kv events of %s: replay failed", self.source.backend)
                self._forget()
                self.resyncs += 1

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """A dropped connection makes the next batch check continuity even without a
        gap: a server that restarted meanwhile may have numbered up to where we were."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self.disconnects += 1
                    self._suspect = True
        finally:
            monitor.close(linger=0)

    async def _on_live(self, seq: int, payload: bytes) -> None:
        suspect, self._suspect = self._suspect, False
        if self._last_live is not None and seq <= self._last_live:
            log.info("kv events of %s restarted at %d", self.source.backend, seq)
            self.restarts += 1
            self._forget()
        self._last_live = seq
        if self._next is not None and seq < self._next:
            return  # a replay applied it already
        if (self._next is None and seq > 0) or (self._next is not None
                                                 and (seq > self._next or suspect)):
            if self._next is not None and seq > self._next:
                self.gaps += 1
            await self._catch_up()
            if self._next is not None and seq < self._next:
                return
            if self._next is not None and seq > self._next:  # a hole no replay filled
                self._forget()
                self.resyncs += 1
        self._apply(seq, payload)

    async def _catch_up(self) -> None:
        """Replay what was missed; on any doubt about continuity, drop and rebuild."""
        if self._next is not None:
            batches = await self._fetch(self._next - 1)
            if batches and batches[0][0] == self._next - 1 \
                    and self._timestamp(batches[0][1]) == self._last_ts:
                for seq, payload in batches[1:]:
                    self._apply(seq, payload)
                return
            log.info("kv events of %s: lost continuity at %d, resyncing",
                     self.source.backend, self._next)
            self._forget()
            self.resyncs += 1
        for seq, payload in await self._fetch(0) or []:
            self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        if self._next is not None and seq != self._next:
            return  # not contiguous (replayed batches are; callers checked the rest)
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError:
            self.decode_errors += 1
            self._forget()  # its events are lost: the rank's blocks can't be trusted
            self._next = seq + 1
            return
        rank = self.source.rank if batch.data_parallel_rank is None else batch.data_parallel_rank
        self._ranks.add(rank)
        for event in batch.events:
            self._index.apply(self.source.backend, rank, event)
        self.batches += 1
        self.events += len(batch.events)
        self.unknown_events += batch.unknown
        self._next, self._last_ts = seq + 1, batch.ts

    def _forget(self) -> None:
        for rank in self._ranks:
            self._index.clear(self.source.backend, rank)
        self._next = self._last_ts = None

    def _timestamp(self, payload: bytes) -> float | None:
        try:
            return self._decoder.decode(payload).ts
        except msgspec.DecodeError:
            return None

    async def _fetch(self, start: int) -> list[tuple[int, bytes]] | None:
        """The buffered batches from `start` on, or None: no replay endpoint, or no
        complete answer in time."""
        if self.source.replay_endpoint is None:
            return None
        self.replays += 1
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        timeout_ms = int(self.source.replay_timeout_s * 1000)
        try:
            dealer.connect(self.source.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            batches: list[tuple[int, bytes]] = []
            while await dealer.poll(timeout_ms):
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self.decode_errors += 1
                    return None
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq < 0:  # the end marker
                    return batches
                batches.append((seq, frames[3]))
            return None
        finally:
            dealer.close(linger=0)
