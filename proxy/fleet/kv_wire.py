"""vLLM's KV cache events as they arrive on the wire, decoded with msgspec.

A ZMQ message is three frames: the topic, an 8-byte big-endian sequence number and
a msgpack payload (vllm/distributed/kv_events.py:495-499). The payload is an
`EventBatch`, an `array_like` struct, so a msgpack array `[ts, events, dp_rank]`
whose trailing rank is left out when None (kv_events.py:31-39, `omit_defaults`).
Each event is a tagged struct *without* `array_like`, so a msgpack map with
`"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"` and every field that
differs from its default (kv_events.py:42-138). Hashes are the low 64 bits of the
block hash as an int, or the whole digest as bytes when vLLM runs with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (vllm/v1/core/kv_cache_utils.py:96-99); both
become the low 64 bits here.

Events are decoded one by one, so an event type a newer vLLM adds is skipped and
counted rather than failing its whole batch.
"""

from __future__ import annotations

import msgspec

_LOW_64 = (1 << 64) - 1


class BlockStored(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    block_size: int = 0
    medium: str | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class EventBatch(msgspec.Struct, frozen=True):
    """One decoded payload: its known events, and how many were of an unknown type."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None
    unknown: int


class Decoder:
    """Reusable msgspec decoders (building them is the costly part)."""

    def __init__(self) -> None:
        self._batch = msgspec.msgpack.Decoder(_Batch)
        self._event = msgspec.msgpack.Decoder(KvEvent)

    def decode(self, payload: bytes) -> EventBatch:
        """Raises msgspec.DecodeError when the payload itself is not a batch."""
        batch = self._batch.decode(payload)
        events: list[KvEvent] = []
        for raw in batch.events:
            try:
                events.append(self._event.decode(raw))
            except msgspec.DecodeError:  # a type or shape this version does not know
                continue
        return EventBatch(batch.ts, events, batch.data_parallel_rank,
                          len(batch.events) - len(events))


def hash64(block_hash: int | bytes) -> int:
    """The low 64 bits, as vLLM's `maybe_convert_block_hash` keeps them."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash, "big") & _LOW_64
    return block_hash & _LOW_64
