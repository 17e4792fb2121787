"""A request raced on two backends: the first leg at once, a hedge after a delay.

A policy's `Decision.hedge` (DiSCo's device-server race, policies/disco) asks for a
second leg on another backend `delay_s` after the first, unless the first has produced
a token by then. The first leg to produce a token keeps the request; the other is
aborted (closing its connection makes vLLM abort it) and its in-flight slot freed. A
leg that fails before its token loses: the other one continues (or opens at once, if
it was still waiting). Nothing reaches the client during the race, so the winner is
relayed as any single answer: its `Opened.head` holds every byte read so far.

"A token" is the first event that is not chat's role-only opening chunk (vLLM sends
`delta: {role, content: ""}` first); an error event, or a stream that ends, also ends
that leg's race (it is the leg's answer, relayed as without a race). A whole answer
(not streamed) produces its token when it is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from proxy.relay.sse import DONE, EventSplitter
from proxy.relay.upstream import Opened, UpstreamFailure
from proxy.types import Backend

OpenLeg = Callable[[Backend], Awaitable[Opened]]
Hold = Callable[[str], AbstractContextManager[None]]


class NoWinner(Exception):
    """Both legs failed before their first token."""


@dataclass(slots=True, eq=False)
class RaceLeg:
    """One backend's part of a race."""

    backend: Backend
    hedge: bool  # the delayed second leg
    started_at: float | None = None  # None: never opened
    token_at: float | None = None  # when it produced its first token (it won)
    ended_at: float | None = None  # when it failed or was aborted
    failure: UpstreamFailure | None = None
    no_room: bool = False  # its time came while its backend was full (flow control)
    opened: Opened | None = None
    guard: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def abort(self) -> None:
        """Close its answer (vLLM aborts the request) and free its slot."""
        if self.ended_at is None and self.started_at is not None:
            self.ended_at = time.monotonic()
        if self.opened is not None:
            self.opened.close()
            self.opened = None
        self.guard.close()

    @property
    def ran_s(self) -> float:
        """How long it ran before it ended (or produced its token)."""
        if self.started_at is None:
            return 0.0
        end = self.token_at or self.ended_at or time.monotonic()
        return end - self.started_at


@dataclass(slots=True, eq=False)
class Race:
    """Both legs, once decided: `winner` is None when neither produced a token."""

    first: RaceLeg
    second: RaceLeg
    delay_s: float
    winner: RaceLeg | None = None

    @property
    def loser(self) -> RaceLeg | None:
        if self.winner is None:
            return None
        return self.second if self.winner is self.first else self.first

    @property
    def hedge_opened(self) -> bool:
        return self.second.started_at is not None


def new_race(first: Backend, second: Backend, delay_s: float) -> Race:
    return Race(RaceLeg(first, False), RaceLeg(second, True), delay_s)


async def run_race(race: Race, open_leg: OpenLeg, hold: Hold, may_open: Callable[[Backend],
                   bool], chat: bool, read_timeout_s: float,
                   failed: Callable[[RaceLeg], None]) -> None:
    """Race `race.first` (now) and `race.second` (after `race.delay_s`, unless the first
    has a token, and only if `may_open(its backend)` then); `hold(backend name)` is a
    leg's in-flight slot, `failed(leg)` runs for each leg that fails before its token.
    The loser is aborted before this returns; the winner keeps its `opened` and `guard`
    (the caller's to close). Cancelled: both legs aborted."""
    runs: dict[asyncio.Task[None], RaceLeg] = {}

    def start(leg: RaceLeg) -> None:
        leg.started_at = time.monotonic()
        task = asyncio.create_task(_run_leg(leg, open_leg, hold, chat, read_timeout_s))
        runs[task] = leg

    start(race.first)
    try:
        hedge_at = time.monotonic() + max(0.0, race.delay_s)
        hedge_due = True
        while runs or hedge_due:
            wait_s = max(0.0, hedge_at - time.monotonic()) if hedge_due else None
            if hedge_due and (wait_s == 0.0 or not runs):
                hedge_due = False
                if may_open(race.second.backend):  # (flow control: room there now)
                    start(race.second)
                else:
                    race.second.no_room = True
                continue
            done, _ = await asyncio.wait(runs, timeout=wait_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: runs[t].token_at or float("inf")):
                leg = runs.pop(task)
                if leg.failure is None and race.winner is None:
                    race.winner = leg
                elif leg.failure is None:
                    leg.abort()  # a token too, but later
                else:
                    failed(leg)
            if race.winner is not None:
                break
    finally:
        for task, leg in runs.items():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            leg.abort()
        if race.winner is None:  # cancelled (or every leg failed): nothing is kept
            race.first.abort()
            race.second.abort()


async def _run_leg(leg: RaceLeg, open_leg: OpenLeg, hold: Hold, chat: bool,
                   read_timeout_s: float) -> None:
    """Open the leg and read it to its first token; a failure is kept in `leg.failure`
    (and the leg aborted), a cancel aborts it."""
    try:
        leg.guard.enter_context(hold(leg.backend.name))
        leg.opened = await open_leg(leg.backend)
        await _until_token(leg.opened, chat, read_timeout_s)
        leg.token_at = time.monotonic()
    except UpstreamFailure as failure:
        leg.failure = failure
        leg.abort()
    except BaseException:
        leg.abort()
        raise


async def _until_token(opened: Opened, chat: bool, read_timeout_s: float) -> None:
    """Read `opened` until its first token; its `head` grows by what was read."""
    if opened.complete:
        return
    splitter = EventSplitter()
    payloads = splitter.feed(opened.head)
    while not any(_ends_wait(p, chat) for p in payloads):
        try:
            async with asyncio.timeout(read_timeout_s):
                chunk = await opened.next_chunk()
        except TimeoutError:
            raise UpstreamFailure(opened.backend, "timeout", "no token in time") from None
        except aiohttp.ClientError as exc:
            raise UpstreamFailure(opened.backend, "broken", repr(exc)) from None
        if not chunk:
            return  # the stream ended: the relay judges what it holds
        opened.head += chunk
        payloads = splitter.feed(chunk)


def _ends_wait(payload: bytes, chat: bool) -> bool:
    """Whether the event is more than chat's role-only opening chunk."""
    if not chat or payload == DONE:
        return True
    try:
        event: Any = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return True
    choices = event.get("choices") if isinstance(event, dict) else None
    if not isinstance(choices, list) or not choices:
        return True  # an error, or a usage event
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or choice.get("finish_reason") is not None \
                or choice.get("token_ids"):
            return True
        if any(value for key, value in delta.items() if key != "role"):
            return True
    return False
