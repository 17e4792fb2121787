"""One backend's part of a tracked request: its response, read event by event.

A tracked request has one leg per backend it ran on. A leg owns its upstream
response, its in-flight count and its stall watch; closing it releases all three,
which also tells vLLM to abort the request there.
"""

from __future__ import annotations

import contextlib
import time

import aiohttp

from proxy.migration.event_pieces import Piece, UpstreamEventError, parse_event
from proxy.relay.sse import DONE, EventSplitter
from proxy.relay.upstream import Opened, StallWatch

_FAILED_FINISH = ("abort", "error")
# Events decoded per read. A proxy that falls behind gets a whole buffer of events in
# one chunk (hundreds); decoded at once, they and their re-encoded copies would stay
# alive while the client's socket drains, for every stream (README, Memory).
MAX_PIECES = 32


class LegFailed(Exception):
    """The backend stopped giving a usable stream; the generation may move."""

    def __init__(self, kind: str, detail: str,
                 refusal: tuple[int, bytes] | None = None) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind  # broken | timeout | error | refused
        self.detail = detail
        # refused: (status, the error event's payload) of a backend refusing the request
        # (a 4xx error event): the client's error, which no other backend would take
        self.refusal = refusal


class Leg:
    def __init__(self, opened: Opened, chat: bool, guard: contextlib.ExitStack,
                 read_timeout_s: float) -> None:
        self.opened = opened
        self.backend = opened.backend
        self.chat = chat  # the format of this leg's events (a continuation is completions)
        self.started_at = time.monotonic()
        self.last_at = self.started_at
        self.first_token_at: float | None = None
        self.tokens = 0
        self._guard = guard
        self._splitter = EventSplitter()
        self._payloads = self._splitter.feed(opened.head)
        self._done = False
        self._failed: LegFailed | None = None
        self._watch = StallWatch(opened.close, read_timeout_s, lambda: self.last_at)
        # Set when this leg continues a sequence re-tokenized for another tokenizer:
        # (prompt + generated ids in its vocabulary, its tokenizer, where the generated
        # ones begin).
        self.rebase: tuple[list[int], str, int] | None = None
        # Tokens (and their text) the client has that this leg generates again first:
        # a continuation started before where the client is (proxy/migration/handoff.py).
        self.replayed = 0
        self._replay_ids = self._replay_chars = 0

    def replay(self, tokens: int, chars: int) -> None:
        """Drop this leg's first `tokens` token ids and `chars` characters of text."""
        self.replayed, self._replay_ids, self._replay_chars = tokens, tokens, chars

    async def read(self) -> list[Piece]:
        """The next pieces (never empty); [] once the stream ended with [DONE]."""
        if self._failed is not None:  # after the pieces read before it
            raise self._failed
        while True:
            if self._payloads:
                batch = self._payloads[:MAX_PIECES]
                del self._payloads[:MAX_PIECES]
                pieces = self._parse(batch)
                if self._done:
                    self._payloads = []
                if pieces:
                    return pieces
            if self._done:
                return []
            try:
                chunk = await self.opened.next_chunk()
            except (aiohttp.ClientError, TimeoutError) as exc:
                kind = "timeout" if self._watch.fired or isinstance(exc, TimeoutError) \
                    else "broken"
                raise LegFailed(kind, repr(exc)) from None
            if not chunk:
                raise LegFailed("broken", "stream ended without [DONE]")
            self.last_at = time.monotonic()
            self._payloads = self._splitter.feed(chunk)

    def _parse(self, payloads: list[bytes]) -> list[Piece]:
        pieces: list[Piece] = []
        for payload in payloads:
            if payload == DONE:
                self._done = True
                break
            try:
                piece = parse_event(payload, self.chat)
            except UpstreamEventError as exc:
                failed = LegFailed("refused" if exc.refusal else "error", str(exc),
                                   exc.refusal)
                if not pieces:
                    raise failed from None
                self._failed = failed  # the pieces before it come first
                break
            if (self._replay_ids or self._replay_chars) and not self._past_replay(piece):
                continue
            if piece.token_ids:
                self.tokens += len(piece.token_ids)
                if self.first_token_at is None:
                    self.first_token_at = self.last_at
            pieces.append(piece)
            if piece.finish_reason in _FAILED_FINISH:
                raise LegFailed("error", f"backend finished with {piece.finish_reason}")
        return pieces

    def _past_replay(self, piece: Piece) -> bool:
        """Cut what is replayed off `piece`; whether anything is left of it."""
        ids = min(self._replay_ids, len(piece.token_ids))
        chars = min(self._replay_chars, len(piece.text))
        self._replay_ids -= ids
        self._replay_chars -= chars
        piece.token_ids, piece.text = piece.token_ids[ids:], piece.text[chars:]
        return bool(piece.token_ids or piece.text or piece.finish_reason is not None
                    or piece.usage is not None)

    def tpot(self) -> float | None:
        if self.first_token_at is None or self.tokens < 2:
            return None
        return (self.last_at - self.first_token_at) / (self.tokens - 1)

    def close(self) -> None:
        self._watch.cancel()
        self.opened.close()
        self._guard.close()
