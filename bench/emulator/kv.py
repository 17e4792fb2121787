"""Paged KV cache with prefix caching, as vLLM's block pool does it, kept by count.

Blocks hold `block_size` tokens. A full block is named by a hash chained over its
tokens and its parent's name, so equal prefixes give equal names; a named block is
the prefix cache. A named block no request holds stays cached but counts as free
("idle"): it is reused, and its name forgotten, only when a fresh block is needed and
no plain one is left, least recently freed first (vLLM's free-block queue; a
request's blocks are freed tail first). Usage = 1 - free / total.

Blocks have no identity beyond their name, so memory grows with the blocks in use or
cached, never with the capacity: hundreds of idle instances cost nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    return hash((parent, *token_ids))


class KvCache:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._plain_free = num_blocks  # free blocks with nothing cached in them
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, free, LRU first
        self._held: dict[int, int] = {}  # cached block in use -> requests holding it

    @property
    def free_blocks(self) -> int:
        return self._plain_free + len(self._idle)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def match(self, names: Sequence[int]) -> int:
        """How many leading blocks of `names` are cached."""
        count = 0
        for name in names:
            if name not in self._held and name not in self._idle:
                break
            count += 1
        return count

    def can_hold(self, fresh: int, reused: Sequence[int] = ()) -> bool:
        """Whether `fresh` new blocks fit once the cached `reused` ones are held."""
        idle_reused = sum(1 for name in reused if name in self._idle)
        return fresh <= self.free_blocks - idle_reused

    def hold(self, names: Sequence[int]) -> None:
        for name in names:
            if name in self._idle:
                del self._idle[name]
                self._held[name] = 1
            else:
                self._held[name] += 1

    def allocate(self, count: int) -> None:
        """Take `count` fresh blocks (the caller checked `can_hold`): plain ones
        first, then the least recently freed cached ones, whose names are forgotten."""
        plain = min(count, self._plain_free)
        self._plain_free -= plain
        for _ in range(count - plain):
            self._idle.popitem(last=False)

    def adopt(self, name: int) -> bool:
        """A held block just became full: cache it under `name`. False when that
        content is cached already (the block stays a plain one)."""
        if name in self._held or name in self._idle:
            return False
        self._held[name] = 1
        return True

    def release(self, names: Sequence[int], plain: int) -> None:
        """Drop a request's holds: its named blocks (tail first) and `plain` others."""
        for name in reversed(names):
            holders = self._held[name] - 1
            if holders:
                self._held[name] = holders
            else:
                del self._held[name]
                self._idle[name] = None
        self._plain_free += plain
