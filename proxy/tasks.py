"""Stopping the proxy's background tasks, even ones whose libraries lose a cancel."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

log = logging.getLogger("laneway")
_GRACE_S = 0.25  # a cancelled task's own cleanup (its `finally`) gets this long ...
_RECANCEL_S = 0.05  # ... before it is cancelled again, this often while it runs


async def stop_task(task: asyncio.Task[Any] | None, within_s: float = 5.0) -> None:
    """Cancel `task` and wait until it ends, cancelling it again while it runs
    (after a grace that lets the cleanup of a task that took the first cancel finish).

    One cancel is not always enough: redis-py's asyncio pipeline can swallow it (seen
    on Python 3.11 with redis 7.4 to 8.1: `pipe.execute()` cancelled at the wrong moment
    returns normally), and a sync loop that lost its cancel would run on and hang the
    shutdown that waits for it. A task that has not ended after `within_s` is left
    running, with a warning, so that shutdown still ends."""
    if task is None:
        return
    deadline = time.monotonic() + within_s
    pause = _GRACE_S
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=min(pause, max(0.0, deadline - time.monotonic())))
        pause = _RECANCEL_S
        if time.monotonic() >= deadline and not task.done():
            log.warning("background task %s did not stop within %.1f s; left running",
                        task.get_name(), within_s)
            return
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("background task %s ended with %s: %s", task.get_name(),
                    type(exc).__name__, exc)
