"""Which backends were sent which prompt prefixes: the proxy's estimate of H_{r,g}.

Keys are the cumulative prefix-block hashes of `RequestContext.prompt_blocks`; each
maps to the backends that received that prefix, most recent last. Bounded as an LRU
over blocks; blocks are touched deepest first, so eviction drops a prompt's longer
extensions before its shorter prefixes.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, max_entries: int, max_backends_per_block: int = 8) -> None:
        self._owners: OrderedDict[bytes, list[str]] = OrderedDict()
        self._max_entries = max_entries
        self._per_block = max_backends_per_block

    def matched_blocks(self, blocks: tuple[bytes, ...]) -> dict[str, int]:
        """For each backend that got a prefix of the prompt: how many leading blocks it
        already got."""
        depths: dict[str, int] = {}
        owners = self._owners
        for depth in range(len(blocks), 0, -1):
            for name in owners.get(blocks[depth - 1], ()):
                if name not in depths:
                    depths[name] = depth
        return depths

    def remember(self, blocks: tuple[bytes, ...], name: str) -> None:
        owners = self._owners
        for block in reversed(blocks):
            names = owners.get(block)
            if names is None:
                owners[block] = [name]
            else:
                if name in names:
                    names.remove(name)
                names.append(name)
                del names[:-self._per_block]
                owners.move_to_end(block)
        while len(owners) > self._max_entries:
            owners.popitem(last=False)


def blocks_to_wire(blocks: tuple[bytes, ...]) -> str:
    """Prefix-block hashes as one hex string (for replication through the state store)."""
    return b"".join(blocks).hex() + f"/{len(blocks[0]) if blocks else 0}"


def blocks_from_wire(wire: str) -> tuple[bytes, ...]:
    hexes, _, width = wire.rpartition("/")
    raw, size = bytes.fromhex(hexes), int(width)
    return tuple(raw[i:i + size] for i in range(0, len(raw), size)) if size else ()
