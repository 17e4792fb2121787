"""The memory and Redis stores: what one replica publishes, the others receive."""

from __future__ import annotations

import asyncio

from proxy.config import StateConfig
from proxy.state import MemoryStore, Outbox
from proxy.state.redis_store import RedisStore


def store(url: str, replica: str, **cfg: object) -> RedisStore:
    return RedisStore(StateConfig.model_validate({"backend": "redis", "redis_url": url,
                                                  **cfg}), replica)


async def test_redis_replicas_see_each_others_writes_counters_and_inflight(
        redis_url: str) -> None:
    a, b = store(redis_url, "a"), store(redis_url, "b")
    try:
        first = await a.exchange(Outbox(entries={"t": [[1, "x"]]}, counters={"k": 2.5},
                                        inflight={"gpu0": 3}), ["k"])
        seen_by_b = await b.exchange(Outbox(counters={"k": 1.0}, inflight={"gpu0": 1,
                                                                          "gpu1": 2}), ["k"])
        seen_by_a = await a.exchange(Outbox(), ["k"])
    finally:
        await a.close()
        await b.close()
    assert first.entries == {}  # a's own writes never come back to it
    assert first.counters == {"k": 2.5}
    assert seen_by_b.entries == {"t": [[1, "x"]]}
    assert seen_by_b.counters == {"k": 3.5}
    assert seen_by_b.inflight == {"gpu0": 3}  # the others' counts, not b's own
    assert seen_by_b.replicas == 2
    assert seen_by_a.inflight == {"gpu0": 1, "gpu1": 2}
    assert seen_by_a.entries == {}  # nothing new since a's last read


async def test_a_silent_replicas_inflight_counts_expire(redis_url: str) -> None:
    crashed, alive = store(redis_url, "crashed", inflight_ttl_s=0.3), store(
        redis_url, "alive", inflight_ttl_s=0.3)
    try:
        await crashed.exchange(Outbox(inflight={"gpu0": 5}), [])
        before = await alive.exchange(Outbox(), [])
        await asyncio.sleep(0.5)  # "crashed" never syncs again (and never closes)
        after = await alive.exchange(Outbox(), [])
    finally:
        await alive.close()
    assert before.inflight == {"gpu0": 5}
    assert after.inflight == {}
    assert after.replicas == 1


async def test_closing_replica_leaves_at_once_and_a_new_one_reads_the_log(
        redis_url: str) -> None:
    a = store(redis_url, "a")
    await a.exchange(Outbox(entries={"t": [["w1"], ["w2"]]}, inflight={"gpu0": 1}), [])
    await a.close()
    late = store(redis_url, "late")
    try:
        inbox = await late.exchange(Outbox(), [])
    finally:
        await late.close()
    assert inbox.inflight == {}
    assert inbox.entries == {"t": [["w1"], ["w2"]]}  # catches up on what it missed


async def test_memory_store_sums_counters_and_forgets_unwanted_ones() -> None:
    mem = MemoryStore()
    await mem.exchange(Outbox(counters={"k": 1.0, "old": 4.0}), ["k", "old"])
    inbox = await mem.exchange(Outbox(counters={"k": 2.0}, inflight={"gpu0": 1}), ["k"])
    assert inbox.counters == {"k": 3.0}
    assert inbox.inflight == {} and inbox.entries == {}
    assert (await mem.exchange(Outbox(), ["old"])).counters == {"old": 0.0}
