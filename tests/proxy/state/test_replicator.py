"""Replicas' mirrors kept in step through a real Redis, and an outage survived."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass

import pytest

from bench.harness.ports import free_port
from bench.harness.services import MissingService, binary, running_redis
from policies.base import Policy, build_policy
from proxy.admission.flow_control import FlowControl
from proxy.config import FlowControlConfig, Settings, StateConfig
from proxy.fleet.registry import Registry
from proxy.observability.metrics import Metrics
from proxy.state import MemoryStore, Outbox, StoreUnavailable, build_store
from proxy.state.rate_counters import RateLimiter, WindowCounters, window_of
from proxy.state.replicator import Replicator
from proxy.state.response_homes import ResponseHomes
from proxy.tasks import stop_task
from proxy.types import NO_PREDICTION, BackendStats
from tests.policies.helpers import backends, ctx

FLEET = backends(4)


@dataclass
class Replica:
    registry: Registry
    policy: Policy
    counters: WindowCounters
    metrics: Metrics
    sync: Replicator
    flow: FlowControl

    def pick(self, prompt: str) -> str:
        view = self.registry.view("m", 0.0)
        return self.policy.pick(ctx(prompt * 8), NO_PREDICTION, view).backend.name


def replica(url: str, name: str, policy: str = "prefix_aware",
            homes: ResponseHomes | None = None, flow_limit: int = 0,
            sync_interval_s: float = 0.05, strict: bool = True) -> Replica:
    """One replica's shared mirrors; with `flow_limit`, (`strict`) flow control too."""
    cfg = StateConfig(backend="redis", redis_url=url, inflight_ttl_s=1.0, timeout_s=0.2,
                      sync_interval_s=sync_interval_s)
    registry = Registry(FLEET)
    registry.publish({b.name: BackendStats(healthy=True) for b in FLEET})
    built = build_policy(policy, {})
    counters, metrics = WindowCounters(), Metrics(registry)
    settings = Settings(state=cfg, flow_control=FlowControlConfig(
        max_inflight_per_backend=flow_limit, strict=strict))
    flow = FlowControl(lambda: settings, registry, metrics)
    shared = {"responses": ResponseHomes() if homes is None else homes}
    sync = Replicator(build_store(cfg, name), cfg, registry, counters, metrics,
                      lambda: built, tables=shared, leasing=flow)
    return Replica(registry, built, counters, metrics, sync, flow)


def redis_port() -> int:
    """A free port for a redis-server the test starts (or restarts) itself; skipped
    without redis-server, as the `redis_url` fixture is."""
    try:
        binary("redis-server")
    except MissingService as exc:
        pytest.skip(str(exc))
    return free_port()


def syncs(r: Replica) -> float:
    samples = next(iter(r.metrics.state_sync.collect())).samples
    return float(next(s.value for s in samples if s.name.endswith("_count")))


def leased(r: Replica) -> list[float]:
    return [r.metrics.flow_leased.labels(b.name)._value.get()  # type: ignore[attr-defined]
            for b in FLEET]


async def test_prefix_index_and_inflight_are_shared(redis_url: str) -> None:
    a, b = replica(redis_url, "a"), replica(redis_url, "b")
    try:
        assert await a.sync.sync_once() and await b.sync.sync_once()
        prompts = [f"conversation {i} " for i in range(8)]
        homes = {p: a.pick(p) for p in prompts}  # a spreads them (least in-flight)
        assert len(set(homes.values())) > 1
        with a.registry.guard("b2"), a.registry.guard("b2"):
            await a.sync.sync_once()
            await b.sync.sync_once()
            b_sees_open = dict(b.registry.inflight)
            b_local = dict(b.registry.local_inflight)
        await a.sync.sync_once()
        await b.sync.sync_once()
        b_sees_closed = b.registry.inflight["b2"]
        # b never saw these prompts, yet sends each where a sent it (prefix match).
        assert {p: b.pick(p) for p in prompts} == homes
    finally:
        await a.sync.store.close()
        await b.sync.store.close()
    assert b_sees_open["b2"] == 2 and b_local["b2"] == 0
    assert b_sees_closed == 0


async def test_fixed_tables_are_shared_beside_a_policy_that_shares_nothing(
        redis_url: str) -> None:
    homes_a, homes_b = ResponseHomes(), ResponseHomes()
    a = replica(redis_url, "a", "round_robin", homes_a)
    b = replica(redis_url, "b", "round_robin", homes_b)
    try:
        assert await a.sync.sync_once() and await b.sync.sync_once()
        homes_a.learn("resp_1", "b2")
        homes_b.learn("resp_2", "b3")
        for _ in range(2):
            await a.sync.sync_once()
            await b.sync.sync_once()
    finally:
        await a.sync.store.close()
        await b.sync.store.close()
    assert (homes_b.get("resp_1"), homes_a.get("resp_2")) == ("b2", "b3")
    assert homes_a.export_updates() == homes_b.export_updates() == []  # not echoed


async def test_goodput_speed_estimates_converge(redis_url: str) -> None:
    a, b = replica(redis_url, "a", "goodput"), replica(redis_url, "b", "goodput")
    stats = BackendStats(healthy=True, tpot_s=0.02, updated_at=1.0)
    speeds_a, speeds_b = a.policy._speeds, b.policy._speeds  # type: ignore[attr-defined]
    try:
        speeds_a.of("b0", stats)
        speeds_b.of("b0", stats)
        for _ in range(5):  # a keeps seeing b0 much slower than b does
            speeds_a.observe_tpot("b0", 0.1)
        await a.sync.sync_once()
        await b.sync.sync_once()
    finally:
        await a.sync.store.close()
        await b.sync.store.close()
    tpot_a, tpot_b = speeds_a.peek("b0").tpot_s, speeds_b.peek("b0").tpot_s
    assert tpot_a > 0.05
    assert abs(tpot_b - (0.02 + tpot_a) / 2) < 1e-12  # b moved half way towards a's


async def test_redis_outage_serves_locally_then_resyncs() -> None:
    port = redis_port()
    down_url = f"redis://127.0.0.1:{port}/0"
    a = replica(down_url, "a")
    limiter = RateLimiter(a.counters)
    now = time.time()
    limiter.charge("k:requests", 3, window_of(now))
    with a.registry.guard("b1"):
        assert await a.sync.sync_once() is False  # nothing listens on the port yet
        assert a.sync.connected is False
        assert a.metrics.state_failures._value.get() == 1  # type: ignore[attr-defined]
        assert limiter.used("k:requests", now) == 3  # still counted locally
        assert a.pick("during the outage ") in {b.name for b in FLEET}  # still routes
        with running_redis(port) as url:
            b = replica(url, "b")
            try:
                assert await a.sync.sync_once() is True  # back: the backlog goes out
                # b admits its first request of key k, then learns the cluster total:
                # a's 3 from during the outage and its own 1.
                b_limiter = RateLimiter(b.counters)
                b_limiter.charge("k:requests", 1, window_of(now))
                await b.sync.sync_once()
                assert b_limiter.used("k:requests", now) == 4
                assert b.registry.inflight["b1"] == 1
                assert a.metrics.state_connected._value.get() == 1  # type: ignore[attr-defined]
            finally:
                await b.sync.store.close()
                await a.sync.store.close()


async def test_strict_flow_control_leases_slots_at_each_sync(redis_url: str) -> None:
    a = replica(redis_url, "a", flow_limit=4, sync_interval_s=1.0)
    b = replica(redis_url, "b", flow_limit=4, sync_interval_s=1.0)
    try:
        assert await a.sync.sync_once()  # alone: every slot
        assert leased(a) == [4.0] * len(FLEET)
        assert await b.sync.sync_once()  # a holds them all
        assert leased(b) == [0.0] * len(FLEET)
        for r in (a, b):
            assert await r.sync.sync_once()  # a is leased half, b nothing yet:
        assert leased(a) == [2.0] * len(FLEET)  # a may have opened requests within its
        assert leased(b) == [0.0] * len(FLEET)  # 4 while its new lease was on its way
        for r in (a, b):
            assert await r.sync.sync_once()  # a gives back half, b takes it
        assert leased(a) == leased(b) == [2.0] * len(FLEET)
        # A request that finds no slot asks for a sync at once (after a fifth of the
        # interval since the last one), not at the next interval.
        running = asyncio.create_task(a.sync.run())  # syncs now, next in 1 s
        await asyncio.sleep(0.3)
        before = syncs(a)
        assert a.flow.on_short is not None
        a.flow.on_short()
        await asyncio.sleep(0.1)
        after = syncs(a)
        await stop_task(running)
        assert after == before + 1
    finally:
        await a.sync.store.close()
        await b.sync.store.close()


async def test_slots_opened_while_a_lease_is_on_its_way_stay_held(redis_url: str) -> None:
    """A replica may open requests within its current lease while its next lease is on
    its way to the store; the store must count them held, or it gives them to another
    replica (found by `bench.studies.chaos --replicas 2 --max-inflight 3`: 4 open on a backend,
    by the replicas' own counts). Each replica reports its current lease as held (or
    what it has open, if more) until the lease after it."""
    a = replica(redis_url, "a", flow_limit=4, sync_interval_s=1.0)
    b = replica(redis_url, "b", flow_limit=4, sync_interval_s=1.0)
    with contextlib.ExitStack() as opened:
        try:
            for r in (a, b, a, b, a, b):
                assert await r.sync.sync_once()
            assert leased(a) == leased(b) == [2.0] * len(FLEET)
            for x in FLEET:  # b fills its 2 slots on every backend, and 2 more wait
                for _ in range(2):
                    opened.enter_context(b.registry.guard(x.name))
            waiting = [asyncio.create_task(b.flow.view("m", [])) for _ in range(2)]
            await asyncio.sleep(0.01)
            assert await b.sync.sync_once()  # b asks for 4 a backend; a holds 2 of them
            assert leased(b) == [2.0] * len(FLEET)
            lease = a.sync.store.lease_slots

            async def arriving(limit: int, needs: Mapping[str, tuple[int, int]],
                               cap: int | None = None) -> dict[str, int]:
                for x in FLEET:  # two requests open on a within its 2, meanwhile
                    for _ in range(2):
                        opened.enter_context(a.registry.guard(x.name))
                return await lease(limit, needs, cap)

            a.sync.store.lease_slots = arriving  # type: ignore[method-assign]
            assert await a.sync.sync_once()
            assert leased(a) == [0.0] * len(FLEET)  # b needs them all; a has 2 open
            assert await b.sync.sync_once()
            assert leased(b) == [2.0] * len(FLEET)  # not 4: a's 2 are still open
            assert not any(w.done() for w in waiting)
            for w in waiting:
                w.cancel()
        finally:
            await a.sync.store.close()
            await b.sync.store.close()


async def test_strict_leases_fall_to_a_share_when_the_store_is_gone_too_long() -> None:
    port = redis_port()
    with running_redis(port) as url:
        a = replica(url, "a", flow_limit=4)
        b = replica(url, "b", flow_limit=4)
        try:
            for r in (a, b, a):
                assert await r.sync.sync_once()
            assert leased(a) == [2.0] * len(FLEET) and a.sync.replicas == 2
            a.flow.leased({x.name: 3 for x in FLEET})  # say a held more before the outage
        finally:
            await b.sync.store.close()
    assert await a.sync.sync_once() is False  # Redis gone
    assert leased(a) == [3.0] * len(FLEET)  # within inflight_ttl_s: its last leases
    await asyncio.sleep(1.1)
    assert await a.sync.sync_once() is False
    assert leased(a) == [2.0] * len(FLEET)  # the others dropped them: 4 // 2 replicas
    await a.sync.store.close()


async def test_strict_leases_keep_to_a_share_when_the_store_comes_back_empty() -> None:
    """Redis restarted without its data (no persistence, or a failover to an empty
    replica) no longer shows what the other replicas hold: the first replica back
    must not lease the whole limit while the others still hold their slots. Each that
    finds the store has lost it keeps to an equal part of each limit (by the replicas
    last seen) for inflight_ttl_s, by when every live replica has written what it holds
    (found by `bench.studies.chaos --replicas 2 --max-inflight 3`: 5 requests on a backend)."""
    port = redis_port()
    with running_redis(port) as url:
        a = replica(url, "a", flow_limit=4)
        b = replica(url, "b", flow_limit=4)
        for r in (a, b, a, b, a, b):  # (a gives back half of its 4 in two leases)
            assert await r.sync.sync_once()
        assert leased(a) == leased(b) == [2.0] * len(FLEET)
    with running_redis(port):  # back at once (within inflight_ttl_s), and empty
        try:
            # a is back first (its first try finds the old connection closed): b's 2
            # slots are not in the store
            assert await a.sync.sync_once() or await a.sync.sync_once()
            assert leased(a) == [2.0] * len(FLEET)  # 4 // 2, not all 4
            assert await b.sync.sync_once() or await b.sync.sync_once()
            assert leased(b) == [2.0] * len(FLEET)
            await b.sync.store.close()  # b leaves: a keeps to its share for the TTL
            assert await a.sync.sync_once()
            assert leased(a) == [2.0] * len(FLEET)
            await asyncio.sleep(1.1)  # inflight_ttl_s since the store was found empty
            assert await a.sync.sync_once()
            assert leased(a) == [4.0] * len(FLEET)  # alone now: every slot
        finally:
            await a.sync.store.close()
            await b.sync.store.close()


async def test_a_replica_starting_without_the_store_takes_its_share_at_once() -> None:
    """It was never seen by the others: no lease of its to wait out."""
    a = replica(f"redis://127.0.0.1:{free_port()}/0", "a", flow_limit=4)  # nothing there
    assert await a.sync.sync_once() is False
    assert leased(a) == [4.0] * len(FLEET)  # no other replica seen: 4 // 1
    await a.sync.store.close()


async def test_replicas_whose_flow_control_differs_are_told(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A loose replica (or one with another limit) beside strict ones breaks the limit
    the leases hold: every replica warns once per change and shows it in
    laneway_state_flow_modes, and says when they agree again. A crashed replica's mode
    leaves the store with it."""
    def modes(r: Replica) -> float:
        return float(r.metrics.state_flow_modes._value.get())  # type: ignore[attr-defined]

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if "differ in flow control" in r.getMessage()]

    caplog.set_level("INFO", logger="laneway.state")
    a, b = replica(redis_url, "a", flow_limit=4), replica(redis_url, "b", flow_limit=4)
    loose = replica(redis_url, "c", flow_limit=4, strict=False)
    crashed = replica(redis_url, "d", flow_limit=8)
    try:
        for r in (a, b, a):
            assert await r.sync.sync_once()
        assert modes(a) == modes(b) == 1 and warnings() == []
        assert await loose.sync.sync_once()
        for _ in range(2):
            assert await a.sync.sync_once()
        assert modes(loose) == modes(a) == 2
        assert warnings() == [
            "replicas differ in flow control, so no replica holds the limit for all: loose,"
            " 4 per backend (1 replica); strict, 4 per backend (2 replicas) (set "
            "flow_control.strict and max_inflight_per_backend alike on every replica)"] * 2
        await loose.sync.store.close()  # leaves
        assert await a.sync.sync_once()
        assert modes(a) == 1
        assert "replicas agree on flow control again: strict, 4 per backend" \
            in caplog.text
        assert await crashed.sync.sync_once()  # another limit, then gone for good
        assert await a.sync.sync_once()
        assert modes(a) == 2 and "strict, 8 per backend (1 replica)" in warnings()[-1]
        await asyncio.sleep(1.1)  # inflight_ttl_s: the others drop it
        for r in (b, a):
            assert await r.sync.sync_once()
        assert modes(a) == 1
        client = crashed.sync.store._client  # type: ignore[attr-defined]
        assert sorted(await client.hkeys("laneway:flow")) == [b"a", b"b"]
    finally:
        for r in (a, b, crashed):
            await r.sync.store.close()


class _LeasesFail(MemoryStore):
    async def lease_slots(self, limit: int, needs: Mapping[str, tuple[int, int]],
                          cap: int | None = None) -> dict[str, int]:
        raise StoreUnavailable("lease refused")


async def test_a_failed_lease_after_an_exchange_does_not_send_the_exchange_twice() -> None:
    cfg = StateConfig(backend="redis")  # strict flow control leases (on a stand-in store)
    registry = Registry(FLEET)
    counters, metrics = WindowCounters(), Metrics(registry)
    settings = Settings(state=cfg, flow_control=FlowControlConfig(max_inflight_per_backend=2))
    store = _LeasesFail()
    sync = Replicator(store, cfg, registry, counters, metrics,
                      lambda: build_policy("round_robin", {}),
                      leasing=FlowControl(lambda: settings, registry, metrics))
    limiter = RateLimiter(counters)
    now = time.time()
    limiter.charge("k:requests", 3, window_of(now))
    assert await sync.sync_once() is False  # the exchange went through, the lease did not
    assert await sync.sync_once() is False
    totals = await store.exchange(Outbox(), counters.wanted(now))
    assert sum(totals.counters.values()) == 3  # counted once, not once per attempt
    assert limiter.used("k:requests", now) == 3
    assert sync.connected is False


async def test_the_sync_loop_stops_whenever_it_is_stopped(redis_url: str) -> None:
    """Cancelled at any moment of its exchanges with a real Redis, the sync loop ends:
    redis-py's pipeline loses about one cancel in three here (a single cancel-and-wait
    hung a shutdown in CI), so `stop_task` cancels until it ends."""
    one = replica(redis_url, "one", flow_limit=4, sync_interval_s=0.0005)
    rng = random.Random(7)
    for _ in range(60):
        task = asyncio.create_task(one.sync.run())
        await asyncio.sleep(rng.uniform(0.0005, 0.006))
        async with asyncio.timeout(3):
            await stop_task(task)
        assert task.cancelled()
    await one.sync.store.close()
