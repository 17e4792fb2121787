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


async def test_slot_leases_share_the_limit_and_never_add_up_past_it(redis_url: str) -> None:
    a, b = store(redis_url, "a"), store(redis_url, "b")
    try:
        for replica in (a, b):
            await replica.exchange(Outbox(), [])  # both live
        # Nobody needs anything: each holds half the limit, ready for a burst.
        idle = [await a.lease_slots(8, {"g": (0, 0)}), await b.lease_slots(8, {"g": (0, 0)})]
        # a needs 6: a's lease cannot take the slots b holds until b gives them back.
        burst = await a.lease_slots(8, {"g": (0, 6)})
        b_gives = await b.lease_slots(8, {"g": (0, 0)})  # b's part of the slack: 1
        burst_then = await a.lease_slots(8, {"g": (0, 6)})
        # Overload: b has 4 waiting, and a 12 open (more than the limit: opened under
        # earlier leases, e.g. before a reload). Each is granted its part of the limit
        # by need, as far as what the other holds leaves room.
        short_b = await b.lease_slots(8, {"g": (0, 4)})
        over_a = await a.lease_slots(8, {"g": (12, 12)})
        over_b = await b.lease_slots(8, {"g": (0, 4)})
        ending_a = await a.lease_slots(8, {"g": (4, 12)})  # 8 of a's 12 ended
        ending_b = await b.lease_slots(8, {"g": (0, 4)})
    finally:
        await a.close()
        await b.close()
    assert idle == [{"g": 4}, {"g": 4}]
    assert burst == {"g": 4}  # b holds 4
    assert b_gives == {"g": 1}
    assert burst_then == {"g": 7}  # 6 + its half of the slack (1 // 2), then capped at 8 - 1
    assert short_b == {"g": 1}  # its part is ceil(8 * 4 / 10) = 4, but a holds 7
    assert over_a == {"g": 6}  # ceil(8 * 12 / 16)
    assert over_b == {"g": 0}  # a holds its 12 open requests
    assert ending_a == {"g": 6}
    assert ending_b == {"g": 2}  # a holds 6 (its lease); b's part, 2, fits


async def test_a_gone_replicas_slot_leases_are_dropped(redis_url: str) -> None:
    crashed, alive = store(redis_url, "crashed", inflight_ttl_s=0.3), store(
        redis_url, "alive", inflight_ttl_s=0.3)
    try:
        await crashed.exchange(Outbox(), [])
        held = await crashed.lease_slots(4, {"g": (4, 4)})
        await alive.exchange(Outbox(), [])
        before = await alive.lease_slots(4, {"g": (0, 4)})
        await asyncio.sleep(0.5)  # "crashed" never syncs again
        await alive.exchange(Outbox(), [])  # prunes the silent replica
        after = await alive.lease_slots(4, {"g": (0, 4)})
    finally:
        await alive.close()
    assert held == {"g": 4}
    assert before == {"g": 0}
    assert after == {"g": 4}


async def test_a_store_that_lost_a_replica_says_so_and_a_cap_bounds_its_lease(
        redis_url: str) -> None:
    a, b = store(redis_url, "a"), store(redis_url, "b")
    try:
        first = (await a.exchange(Outbox(), [])).rejoined  # new: not there before
        again = (await a.exchange(Outbox(), [])).rejoined
        await b.exchange(Outbox(), [])
        held = await b.lease_slots(8, {"g": (3, 3)})
        capped = await a.lease_slots(8, {"g": (0, 8)}, cap=2)
        await a._client.flushall()  # type: ignore[attr-defined]  # emptied
        lost = (await a.exchange(Outbox(), [])).rejoined
        alone = await a.lease_slots(8, {"g": (0, 8)})  # b's 3 are not in it any more
    finally:
        await a.close()
        await b.close()
    assert (first, again, lost) == (True, False, True)
    assert held == {"g": 5}  # its 3 and half the rest
    assert capped == {"g": 2}  # 8 - 5 would leave 3
    assert alone == {"g": 8}  # why the replicator keeps to a share then


async def test_memory_store_leases_every_slot_to_its_only_replica() -> None:
    assert await MemoryStore().lease_slots(5, {"g": (0, 0), "h": (7, 9)}) == {"g": 5, "h": 5}
    assert await MemoryStore().lease_slots(5, {"g": (0, 0)}, cap=2) == {"g": 2}
