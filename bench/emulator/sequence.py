"""One request inside an emulated engine: its tokens, KV blocks and waiting client.

Token ids follow the fake's rule (`bench.fakes.fake_wire`): generated token i is
`GEN_BASE + i`, and `first_index` continues a sequence whose prompt ends in
generated ids, so a request moved to another instance resumes the same tokens.
"""

from __future__ import annotations

import asyncio

from bench.emulator.kv import block_hash
from bench.fakes.fake_wire import GEN_BASE


class Sequence:
    """One request inside the engine."""

    __slots__ = ("arrival", "computed", "done", "first_index", "hashes", "held",
                 "last_token_at", "max_tokens", "output", "plain", "preemptions",
                 "prompt_ids", "waiter")

    def __init__(self, prompt_ids: list[int], first_index: int, max_tokens: int,
                 arrival: float) -> None:
        self.prompt_ids = prompt_ids
        self.first_index = first_index  # index of the first generated token (`tok<i>`)
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.computed = 0  # tokens whose KV is computed
        self.output = 0  # tokens generated so far
        self.hashes: list[int] = []  # names of the full blocks computed so far
        self.held: list[int] = []  # ... of those, the cached blocks this request holds
        self.plain = 0  # its other blocks (partial, or content cached twice)
        self.done = False
        self.preemptions = 0
        self.last_token_at = 0.0
        self.waiter: asyncio.Future[None] | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + self.output

    @property
    def blocks(self) -> int:
        return len(self.held) + self.plain

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Token ids of positions [start, stop): prompt, then generated `GEN_BASE + i`."""
        prompt = len(self.prompt_ids)
        head = self.prompt_ids[start:min(stop, prompt)]
        base = GEN_BASE + self.first_index - prompt
        return head + list(range(base + max(start, prompt), base + stop)) \
            if stop > prompt else head

    def block_names(self, stop: int, block_size: int) -> list[int]:
        """Chained hashes of the full blocks of positions [0, stop)."""
        names, parent = [], 0
        for start in range(0, stop - block_size + 1, block_size):
            parent = block_hash(parent, self.token_ids(start, start + block_size))
            names.append(parent)
        return names

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def progress(self, seen: int) -> None:
        """Return once more than `seen` tokens exist or the request is done."""
        while self.output <= seen and not self.done:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
