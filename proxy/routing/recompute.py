"""Rebuild a policy's tables in the background (policies.base.Recomputing: DiSCo).

The task reads the current policy at every turn, so a reload that brings (or drops) a
recomputing policy needs nothing else. The rebuild runs on the event loop, between
requests: it reads the windows `observe` writes, which a thread would race with, and
it costs ~1 ms at the default window sizes (docs/disco.md, Scheduler overhead).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from policies.base import Policy, Recomputing

log = logging.getLogger("laneway.routing")
_IDLE_S = 5.0  # how often a policy without tables is looked at again


async def recompute_tables(policy_of: Callable[[], Policy]) -> None:
    """Call the current policy's `recompute` every `recompute_interval_s`, for ever."""
    while True:
        await asyncio.sleep(_interval(policy_of()) or _IDLE_S)
        policy = policy_of()
        if not _interval(policy):
            continue
        assert isinstance(policy, Recomputing)
        try:
            policy.recompute()
        except Exception:  # a bad table must not end the task: the old one stays
            log.exception("policy %s: recomputing its tables failed", policy.name)


def _interval(policy: Policy) -> float:
    return policy.recompute_interval_s if isinstance(policy, Recomputing) else 0.0
