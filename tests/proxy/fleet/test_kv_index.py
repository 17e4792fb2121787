"""proxy/fleet/kv_index.py: copy counts, removal, clear, longest prefix, the cap."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from proxy.fleet.kv_index import KvIndex
from proxy.fleet.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored

CHAIN = [0x1111, 0x2222, 0x3333, 0x4444, 0x5555]


def test_longest_prefix_stops_at_the_first_missing_block() -> None:
    index = KvIndex()
    index.store("a", 0, CHAIN[:3])
    index.store("a", 0, CHAIN[4:])  # block 5 without block 4: not a usable prefix
    assert index.longest_prefix("a", CHAIN) == 3
    assert index.longest_prefix("a", CHAIN[:2]) == 2
    assert index.longest_prefix("a", [0x9999, *CHAIN]) == 0
    assert index.longest_prefix("b", CHAIN) == 0  # a backend never heard of
    assert index.longest_prefix("a", []) == 0


def test_copies_are_counted_and_removed_one_by_one() -> None:
    index = KvIndex()
    index.store("a", 0, CHAIN[:2])
    index.store("a", 0, CHAIN[:1])  # a second physical copy of block 1
    assert index.copies("a", 0, CHAIN[0]) == 2
    index.remove("a", 0, [CHAIN[0]])
    assert index.longest_prefix("a", CHAIN) == 2  # one copy is left
    index.remove("a", 0, [CHAIN[0]])
    assert index.longest_prefix("a", CHAIN) == 0
    assert index.copies("a", 0, CHAIN[0]) == 0
    index.remove("a", 0, [CHAIN[0], 0x7777])  # unknown or gone: never negative
    assert index.copies("a", 0, CHAIN[0]) == 0
    assert index.size("a") == 1


def test_ranks_are_separate_caches() -> None:
    index = KvIndex()
    index.store("a", 0, CHAIN[:2])
    index.store("a", 1, CHAIN[:4])
    assert index.longest_prefix("a", CHAIN) == 4  # the best rank
    index.clear("a", 1)
    assert index.longest_prefix("a", CHAIN) == 2
    assert index.copies("a", 1, CHAIN[0]) == 0
    assert index.copies("a", 0, CHAIN[0]) == 1


def test_apply_events_and_drop() -> None:
    index = KvIndex()
    index.apply("a", 0, BlockStored(block_hashes=[*CHAIN[:3]], parent_block_hash=None))
    # a whole digest (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) counts by its low 64 bits
    index.apply("a", 0, BlockStored(block_hashes=[b"\xff" * 24 + (0x4444).to_bytes(8, "big")],
                                    parent_block_hash=CHAIN[2]))
    index.store("b", 0, CHAIN)
    assert index.longest_prefix("a", CHAIN) == 4
    index.apply("a", 0, BlockRemoved(block_hashes=[CHAIN[1]]))
    assert index.longest_prefix("a", CHAIN) == 1
    index.apply("a", 0, AllBlocksCleared())
    assert index.size("a") == 0
    index.drop("b")
    assert index.longest_prefix("b", CHAIN) == 0
    assert "b" not in index.backends()


def test_cap_trims_the_oldest_blocks_per_backend() -> None:
    index = KvIndex(max_blocks_per_backend=64)
    index.store("other", 0, range(10_000, 10_010))
    index.store("a", 0, range(64))
    assert index.size("a") == 64 and index.trimmed == 0
    index.store("a", 0, [0])  # stored again: young again
    index.store("a", 0, [64])  # one over the cap: the oldest eighth goes
    assert index.size("a") == 64 - 8
    assert index.trimmed == 9
    assert index.copies("a", 0, 0) == 2  # refreshed, so kept
    assert index.copies("a", 0, 1) == 0 and index.copies("a", 0, 9) == 0
    assert index.copies("a", 0, 10) == 1 and index.copies("a", 0, 64) == 1
    assert index.size("other") == 10  # another backend's blocks are not touched
    for start in range(100, 10_000, 50):
        index.store("a", 0, range(start, start + 50))
        assert index.size("a") <= 64


def test_cap_must_leave_room() -> None:
    with pytest.raises(ValueError):
        KvIndex(max_blocks_per_backend=0)


def test_bytes_per_block_as_documented() -> None:
    """The module docstring's 66-96 bytes per block, measured on random 64-bit hashes
    (stored from decoded ints, so each key is a new int object, as in production)."""
    rng = random.Random(7)
    for count in (60_000, 175_000):
        hashes = [rng.getrandbits(64) for _ in range(count)]
        index = KvIndex()
        tracemalloc.start()
        try:
            index.store("a", 0, hashes)
            used, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert index.size("a") == count
        assert 50 < used / count < 110
