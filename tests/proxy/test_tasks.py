"""stop_task: a background task is stopped even when a cancel is lost on the way."""

from __future__ import annotations

import asyncio
import logging

import pytest

from proxy.tasks import stop_task


async def _swallows_cancels(times: list[int], ticks: list[int]) -> None:
    """A loop that, like redis-py's pipeline at the wrong moment, loses a cancel
    (`times[0]` of them)."""
    lost = 0
    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if lost >= times[0]:
                raise
            lost += 1
        ticks.append(lost)


async def test_a_task_that_loses_cancels_is_stopped() -> None:
    ticks: list[int] = []
    task = asyncio.create_task(_swallows_cancels([2], ticks))
    await asyncio.sleep(0.03)
    async with asyncio.timeout(2):  # a single cancel and wait would hang here
        await stop_task(task)
    assert task.cancelled() and max(ticks) == 2


async def test_a_task_that_never_stops_is_left_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    times = [10**9]
    task = asyncio.create_task(_swallows_cancels(times, []), name="stubborn")
    await asyncio.sleep(0.03)  # running (a task cancelled before it starts never runs)
    with caplog.at_level(logging.WARNING, "laneway"):
        await stop_task(task, within_s=0.2)
    assert not task.done() and "stubborn did not stop within 0.2 s" in caplog.text
    times[0] = 0
    await stop_task(task)


async def test_a_task_that_failed_is_logged_not_raised(
        caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fails(), name="failing")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, "laneway"):
        await stop_task(task)
        await stop_task(None)
    assert "failing ended with RuntimeError: boom" in caplog.text


async def test_the_cleanup_of_a_cancelled_task_is_not_cut_short() -> None:
    cleaned: list[str] = []

    async def tidy() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            await asyncio.sleep(0.1)  # closing its connections, say
            cleaned.append("done")

    task = asyncio.create_task(tidy())
    await asyncio.sleep(0.01)
    await stop_task(task)
    assert task.cancelled() and cleaned == ["done"]
