"""Which KV blocks each backend holds, from its own KV cache events: the exact index.

A block is the low 64 bits of vLLM's chained block hash (proxy/routing/block_hashes.py
recomputes them from a prompt's token ids). The index counts copies, not presence:
vLLM caches every physical block under its hash without de-duplicating (two requests
that prefill the same prefix in one step both store it) and announces one
`BlockRemoved` per copy it evicts (vllm/v1/core/block_pool.py:590-624), so a hash
stays while any copy does. Each data-parallel rank of a backend is its own cache.

Memory: one dict per backend whose key is the hash with the rank above bit 64 (rank 0
keys are the bare hash), value the copy count (a cached small int). Measured with
tracemalloc (tests/proxy/fleet/test_kv_index.py): 66 to 96 bytes per block (a 36-byte int
key plus the dict's slot, by how full its table is), so the default cap of 1,000,000
blocks bounds a backend at ~100 MB; a GPU holds far fewer (80 GB of an 8B model's KV
is ~30,000 blocks of 16 tokens). Past the cap the oldest
stored blocks go first, an eighth of the cap at a time: vLLM evicts least recently
used blocks too, and a whole-dict rebuild per eighth keeps trimming O(1) amortized
(popping a dict's first key one at a time is not).

Not thread-safe: the event subscribers and the router share one event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice

from proxy.fleet.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, hash64

DEFAULT_MAX_BLOCKS = 1_000_000


def _key(rank: int, block_hash: int) -> int:
    return block_hash | (rank << 64)


class KvIndex:
    def __init__(self, max_blocks_per_backend: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks_per_backend < 8:
            raise ValueError("max_blocks_per_backend must be at least 8")
        self.max_blocks = max_blocks_per_backend
        self._blocks: dict[str, dict[int, int]] = {}  # backend -> key -> copies
        self._ranks: dict[str, set[int]] = {}  # the ranks each backend has announced
        self.trimmed = 0  # blocks dropped by the cap (a sign it is too small)

    def apply(self, backend: str, rank: int, event: KvEvent) -> None:
        if isinstance(event, BlockStored):
            self.store(backend, rank, [hash64(h) for h in event.block_hashes])
        elif isinstance(event, BlockRemoved):
            self.remove(backend, rank, [hash64(h) for h in event.block_hashes])
        elif isinstance(event, AllBlocksCleared):
            self.clear(backend, rank)

    def store(self, backend: str, rank: int, block_hashes: Iterable[int]) -> None:
        blocks = self._blocks.setdefault(backend, {})
        self._ranks.setdefault(backend, set()).add(rank)
        for block_hash in block_hashes:
            key = _key(rank, block_hash)
            # pop and re-insert: a block stored again is young again for the cap
            blocks[key] = blocks.pop(key, 0) + 1
        if len(blocks) > self.max_blocks:
            self._trim(backend, blocks)

    def remove(self, backend: str, rank: int, block_hashes: Iterable[int]) -> None:
        """Unknown hashes are ignored: stored before we listened, or trimmed."""
        blocks = self._blocks.get(backend)
        if blocks is None:
            return
        for block_hash in block_hashes:
            key = _key(rank, block_hash)
            copies = blocks.get(key, 0)
            if copies > 1:
                blocks[key] = copies - 1
            elif copies == 1:
                del blocks[key]

    def clear(self, backend: str, rank: int) -> None:
        """`AllBlocksCleared` from one rank (a prefix-cache reset)."""
        blocks = self._blocks.get(backend)
        if blocks:
            self._blocks[backend] = {k: n for k, n in blocks.items() if k >> 64 != rank}

    def drop(self, backend: str) -> None:
        """Forget a backend: removed, restarted, or its events can no longer be trusted."""
        self._blocks.pop(backend, None)
        self._ranks.pop(backend, None)

    def longest_prefix(self, backend: str, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt's hash chain the backend holds, on its
        best rank: O(blocks) per rank, stopping at the first miss."""
        blocks = self._blocks.get(backend)
        if not blocks:
            return 0
        best = 0
        for rank in self._ranks.get(backend, ()):
            held = 0
            for block_hash in block_hashes:
                if _key(rank, block_hash) not in blocks:
                    break
                held += 1
            best = max(best, held)
        return best

    def copies(self, backend: str, rank: int, block_hash: int) -> int:
        return self._blocks.get(backend, {}).get(_key(rank, block_hash), 0)

    def size(self, backend: str) -> int:
        """Distinct (rank, hash) entries held for a backend."""
        return len(self._blocks.get(backend, ()))

    def backends(self) -> list[str]:
        return list(self._blocks)

    def _trim(self, backend: str, blocks: dict[int, int]) -> None:
        excess = len(blocks) - self.max_blocks + self.max_blocks // 8
        self._blocks[backend] = dict(islice(blocks.items(), excess, None))
        self.trimmed += excess
