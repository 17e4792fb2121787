"""An async context (servers) entered on an event loop in a thread of its own, so that
blocking code — a test's plain calls, a `laneway serve` started and waited for — can
use it without stalling it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def in_a_thread(setup: Callable[[], AbstractAsyncContextManager[T]],
                timeout_s: float = 30.0) -> Iterator[T]:
    """Enter `setup()` on a loop in a thread of its own and yield what it gives; exited
    (and the thread joined) when the block ends. A setup that fails is raised here."""
    up, stop, failed = threading.Event(), threading.Event(), []
    given: list[T] = []

    async def serve() -> None:
        async with setup() as entered:
            given.append(entered)
            up.set()
            await asyncio.to_thread(stop.wait)

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as exc:  # reported below
            failed.append(exc)
            up.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert up.wait(timeout_s) and not failed, failed
        yield given[0]
    finally:
        stop.set()
        thread.join(timeout_s)
