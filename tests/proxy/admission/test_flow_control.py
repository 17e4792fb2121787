"""Flow control (`flow_control`): requests wait in the proxy while every backend of
their model is full, and leave by priority, the keys taking turns within a priority."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest

from bench.fakes.fake_vllm import FakeConfig, RunningFake
from proxy.admission.flow_control import FlowControl
from proxy.config import FlowControlConfig, Settings
from proxy.fleet.registry import Registry
from proxy.hashing import hash_key
from proxy.observability.metrics import Metrics
from proxy.reconfigure import apply_settings
from proxy.types import Backend, BackendStats
from tests.proxy.fakes import ADMIN, CHAT, fleet, post
from tests.proxy.migration.test_migration import (
    MoveToOther,
    continuation_bodies,
    expected_text,
    stream_text,
)

SLOW = FakeConfig(tpot_s=0.02)  # 16 tokens: ~0.3 s a request
KEYS = {"keys": [{"name": "a", "sha256": hash_key("sk-a")},
                 {"name": "b", "sha256": hash_key("sk-b")},
                 {"name": "vip", "sha256": hash_key("sk-vip"), "priority": 5}],
        "enabled": True}


def _limit(n: int, **more: Any) -> dict[str, Any]:
    return {"max_inflight_per_backend": n, **more}


def _asked(fakes: list[RunningFake]) -> list[str]:
    """The first message of each request the fakes got, in the order they got them."""
    return [b["messages"][0]["content"] for f in fakes for b in f.app.stats.bodies]


async def _peak(fakes: list[RunningFake], until: asyncio.Task[Any]) -> int:
    peak = 0
    while not until.done():
        peak = max(peak, *(f.app.stats.running + f.app.stats.waiting for f in fakes))
        await asyncio.sleep(0.005)
    return peak


def _chat(text: str, **more: Any) -> dict[str, Any]:
    return {**CHAT, "messages": [{"role": "user", "content": text}], **more}


async def _send_in_order(proxy: Any, fakes: list[RunningFake],
                         requests: list[tuple[str, dict[str, str]]], first_tokens: int = 100
                         ) -> list[httpx.Response]:
    """Send each (text, headers) once the one before is at a backend, in the proxy's
    queue or answered; all their answers. The first asks for `first_tokens` (2 s at
    SLOW's pace), so that it holds its room while the others line up (at the fakes'
    16, ~0.3 s, it ended before them on a loaded machine), and it must not have ended
    before they did."""
    assert proxy.app.runtime is not None
    flow = proxy.app.runtime.flow
    tasks: list[asyncio.Task[httpx.Response]] = []
    for text, headers in requests:
        before = sum(f.app.stats.requests for f in fakes) + flow.queued
        body = _chat(text, max_tokens=first_tokens) if not tasks else _chat(text)
        tasks.append(asyncio.create_task(post(proxy, body, headers=headers)))
        while True:
            arrived = sum(f.app.stats.requests for f in fakes) + flow.queued > before
            if arrived or tasks[-1].done():
                break
            await asyncio.sleep(0.002)
    assert not tasks[0].done(), "the first request ended before the others lined up"
    return list(await asyncio.gather(*tasks))


async def test_a_backend_never_holds_more_than_its_limit() -> None:
    async with fleet(SLOW, SLOW, flow_control=_limit(2)) as (proxy, fakes):
        sent = asyncio.gather(*(post(proxy, _chat(f"r{i}", stream=i % 2 == 0))
                                for i in range(12)))
        task = asyncio.ensure_future(sent)
        peak = await _peak(fakes, task)
        answers = await task
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            metrics = (await http.get("/metrics")).text
    assert [a.status_code for a in answers] == [200] * 12
    assert peak == 2  # per backend: the 12 requests waited their turn in the proxy
    assert [f.app.stats.requests for f in fakes] == [6, 6]
    assert 'laneway_flow_wait_seconds_count{model="fake",priority="0"} 8.0' in metrics
    assert "laneway_flow_queued_requests 0.0" in metrics


async def test_without_a_limit_every_request_goes_at_once() -> None:
    async with fleet(SLOW) as (proxy, fakes):
        task = asyncio.ensure_future(asyncio.gather(*(post(proxy, _chat(f"r{i}"))
                                                     for i in range(6))))
        peak = await _peak(fakes, task)
        await task
    assert peak == 6


async def test_higher_priority_leaves_the_queue_first() -> None:
    async with fleet(SLOW, flow_control=_limit(1)) as (proxy, fakes):
        answers = await _send_in_order(proxy, fakes, [
            ("busy", {}), ("low1", {}), ("low2", {}),
            ("high", {"x-laneway-priority": "3"}), ("low3", {"x-laneway-priority": "-1"}),
            ("low4", {})])
    assert {a.status_code for a in answers} == {200}
    assert _asked(fakes) == ["busy", "high", "low1", "low2", "low4", "low3"]


async def test_keys_take_turns_and_a_keys_priority_counts() -> None:
    a, b, vip = ({"authorization": f"Bearer sk-{k}"} for k in ("a", "b", "vip"))
    async with fleet(SLOW, flow_control=_limit(1), auth=KEYS) as (proxy, fakes):
        answers = await _send_in_order(proxy, fakes, [
            ("a0", a), ("a1", a), ("a2", a), ("a3", a), ("b1", b), ("b2", b),
            ("vip", vip), ("p", a | {"x-laneway-priority": "9"})])  # header ignored
    assert {r.status_code for r in answers} == {200}
    assert _asked(fakes) == ["a0", "vip", "a1", "b1", "a2", "b2", "a3", "p"]


async def test_a_full_queue_and_a_long_wait_are_overloaded_503s(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "laneway")
    async with fleet(FakeConfig(tpot_s=0.1), flow_control=_limit(
            1, max_queued=2, queue_timeout_s=0.5)) as (proxy, fakes):
        answers = await _send_in_order(proxy, fakes, [(f"r{i}", {}) for i in range(4)],
                                       first_tokens=16)  # 1.6 s at 0.1 s a token
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            metrics = (await http.get("/metrics")).text
    statuses = [a.status_code for a in answers]
    assert statuses == [200, 503, 503, 503]
    assert {a.json()["error"]["code"] for a in answers[1:]} == {"overloaded"}
    assert all(a.headers["retry-after"] == "1" for a in answers[1:])
    assert _asked(fakes) == ["r0"]
    assert 'laneway_flow_rejected_total{model="fake",reason="queue_full"} 1.0' in metrics
    assert 'laneway_flow_rejected_total{model="fake",reason="timeout"} 2.0' in metrics
    shed = [r.getMessage() for r in caplog.records if "flow control shed" in r.getMessage()]
    assert len(shed) == 3  # the decision is in the log, not only in the metrics
    assert sum("queue_full" in m and "max_queued" in m for m in shed) == 1
    assert sum("timeout" in m and "queue_timeout_s" in m for m in shed) == 2


async def test_a_request_whose_room_was_taken_keeps_its_place_in_line() -> None:
    registry = Registry([Backend("b1", "http://b1", "m")])
    registry.publish({"b1": BackendStats(healthy=True)})
    settings = Settings(flow_control=FlowControlConfig(max_inflight_per_backend=1))
    flow = FlowControl(lambda: settings, registry, Metrics(registry))
    with registry.guard("b1"):
        first = asyncio.create_task(flow.view("m", []))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(flow.view("m", []))
        await asyncio.sleep(0.01)
    # The release gave `first` the room; another replica fills it before `first` runs.
    registry.set_remote_inflight({"b1": 1})
    await asyncio.sleep(0.01)
    assert not first.done() and not second.done()  # `first` waits again
    registry.set_remote_inflight({})  # the room is back: the next tick hands it out
    done, _ = await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED)
    assert done == {first}  # at the head of the line, not behind `second`
    second.cancel()


def _two_backends(state: str = "redis", **flow: Any) -> tuple[Registry, FlowControl]:
    registry = Registry([Backend("b1", "http://b1", "m"), Backend("b2", "http://b2", "m"),
                         Backend("x", "http://x", "other")])
    registry.publish({name: BackendStats(healthy=True) for name in ("b1", "b2", "x")})
    settings = Settings.model_validate({"flow_control": flow, "state": {"backend": state}})
    return registry, FlowControl(lambda: settings, registry, Metrics(registry))


async def test_strict_opens_requests_only_within_the_leased_slots() -> None:
    registry, flow = _two_backends(max_inflight_per_backend=4)
    asked: list[int] = []
    flow.on_short = lambda: asked.append(1)
    flow.leased({"b1": 1, "b2": 0})
    assert [b.name for b in (await flow.view("m", [])).candidates] == ["b1"]
    with registry.guard("b1"):
        waiting = [asyncio.create_task(flow.view("m", [])) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert not any(w.done() for w in waiting) and len(asked) == 2  # a sync, now
        # Each backend's (open or promised, + the waiting ones it could take).
        assert flow.lease_needs() == (4, {"b1": (1, 3), "b2": (0, 2), "x": (0, 0)})
        flow.leased({"b1": 1, "b2": 1})  # the sync leased one more slot
        await asyncio.sleep(0.01)
        assert [w.done() for w in waiting] == [True, False]
        assert [b.name for b in waiting[0].result().candidates] == ["b2"]
        # (the test opens nothing on b2, but it holds its lease of 1: a request may
        # open in it while the next lease is on its way; one request waits)
        assert flow.lease_needs() == (4, {"b1": (1, 2), "b2": (1, 1), "x": (0, 0)})
    view = await asyncio.wait_for(waiting[1], 1)  # the slot on b1 came back
    assert [b.name for b in view.candidates] == ["b1", "b2"]


async def test_without_strict_nothing_is_leased_and_a_lost_store_keeps_to_a_share(
        caplog: pytest.LogCaptureFixture) -> None:
    for state, strict in (("redis", False), ("memory", True)):
        _, loose = _two_backends(state, max_inflight_per_backend=4, strict=strict)
        assert loose.lease_needs() is None
        assert len((await loose.view("m", [])).candidates) == 2  # no lease needed
    registry, flow = _two_backends(max_inflight_per_backend=5)
    with caplog.at_level(logging.DEBUG, "laneway"):
        flow.lease_lost(replicas=2)
        flow.lease_lost(replicas=2)  # the next failed sync: said once
    assert caplog.text.count("keeping to 2 of 5 slots per backend (2 replicas") == 1
    assert caplog.text.count("slots leased b1 2, b2 2, x 2 (were none)") == 1
    assert [b.name for b in (await flow.view("m", [])).candidates] == ["b1", "b2"]
    with registry.guard("b1"), registry.guard("b1"):
        assert [b.name for b in (await flow.view("m", [])).candidates] == ["b2"]  # 5 // 2


async def test_a_client_leaving_the_queue_frees_its_place() -> None:
    async with fleet(SLOW, flow_control=_limit(1)) as (proxy, fakes):
        busy = asyncio.create_task(post(proxy, _chat("busy")))
        await asyncio.sleep(0.05)
        with pytest.raises(httpx.ReadTimeout):
            await post(proxy, _chat("gone"), timeout=0.1)
        after = await post(proxy, _chat("after"))
        await busy
    assert after.status_code == 200 and _asked(fakes) == ["busy", "after"]


async def test_pass_through_requests_are_held_too(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "laneway.access")
    async with fleet(SLOW, flow_control=_limit(1), server={"access_log": True}
                     ) as (proxy, _):
        busy = asyncio.create_task(post(proxy, _chat("busy")))
        await asyncio.sleep(0.05)
        embedded = asyncio.create_task(post(proxy, {"model": "fake", "input": "x"},
                                            "/v1/embeddings"))
        await asyncio.sleep(0.1)
        assert not embedded.done()  # the only backend is full
        assert (await busy).status_code == 200 and (await embedded).status_code == 200
    access = {r.getMessage().split()[1]: r.fields for r in caplog.records  # type: ignore[attr-defined]
              if r.name == "laneway.access"}
    assert access["/v1/embeddings"]["queued_ms"] > 100


async def test_the_priority_header_means_nothing_without_flow_control() -> None:
    async with fleet(FakeConfig()) as (proxy, _):
        answer = await post(proxy, CHAT, headers={"x-laneway-priority": "high"})
    assert answer.status_code == 200


@pytest.mark.parametrize("priority", ["high", "11", "-11", "1e3"])
async def test_a_bad_priority_header_is_a_400(priority: str) -> None:
    async with fleet(FakeConfig(), flow_control=_limit(1)) as (proxy, _):
        answer = await post(proxy, CHAT, headers={"x-laneway-priority": priority})
    assert answer.status_code == 400 and "x-laneway-priority" in answer.json()[
        "error"]["message"]


async def test_turning_flow_control_off_releases_the_waiting_requests() -> None:
    async with fleet(FakeConfig(tpot_s=0.2), flow_control=_limit(1)) as (proxy, fakes):
        busy = asyncio.create_task(post(proxy, _chat("busy")))
        await asyncio.sleep(0.05)
        waiting = asyncio.create_task(post(proxy, _chat("waiting")))
        await asyncio.sleep(0.2)
        assert _asked(fakes) == ["busy"]
        rt = proxy.app.runtime
        new = rt.settings.model_copy(update={"flow_control": FlowControlConfig()})
        apply_settings(rt, new, rt.router.policy)
        await asyncio.sleep(0.3)  # a few of flow control's ticks; busy runs ~3 s
        assert _asked(fakes) == ["busy", "waiting"]
        assert {(await busy).status_code, (await waiting).status_code} == {200}


async def test_the_access_log_says_how_long_a_request_queued(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "laneway.access")
    async with fleet(SLOW, flow_control=_limit(1), server={"access_log": True}
                     ) as (proxy, fakes):
        answers = await _send_in_order(proxy, fakes, [("busy", {}), ("queued", {})])
    assert {a.status_code for a in answers} == {200}
    queued = [r.fields.get("queued_ms") for r in caplog.records  # type: ignore[attr-defined]
              if r.name == "laneway.access"]
    assert len(queued) == 2 and queued.count(None) == 1
    assert min(q for q in queued if q is not None) > 100  # "busy" runs ~2 s


# -- a running stream's moves (it was admitted: it never waits in line) ------------
LONG = FakeConfig(tpot_s=0.01)
NO_CHECKS = {"check_every_tokens": 10_000}
DRAINED = 200  # tokens of a stream a test drains mid-way (2 s at LONG's pace)


async def _stream(proxy: Any, text: str, tokens: int) -> asyncio.Task[httpx.Response]:
    """A stream, once its first bytes came (it is running on its backend)."""
    running = asyncio.Event()

    async def read() -> httpx.Response:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as http, http.stream(
                "POST", "/v1/chat/completions",
                json=_chat(text, stream=True, max_tokens=tokens)) as response:
            running.set()
            await response.aread()
            return response

    task = asyncio.create_task(read())
    await asyncio.wait_for(running.wait(), 5)
    return task


async def test_a_policy_move_waits_for_room_instead_of_overfilling_the_target() -> None:
    async with fleet(LONG, LONG, policy={"name": MoveToOther.name}, flow_control=_limit(1),
                     migration={"check_every_tokens": 10}) as (proxy, fakes):
        moving = await _stream(proxy, "a", 30)  # on f0; its checks find f1 full
        other = await _stream(proxy, "b", 60)  # on f1 until after `a` ends
        peak = await _peak(fakes, moving)
        answers = [await moving, await other]
    assert [stream_text(a) for a in answers] == [expected_text(30), expected_text(60)]
    assert [a.headers["x-laneway-backend"] for a in answers] == ["f0", "f1"]
    assert continuation_bodies(fakes[1]) == []
    assert peak == 1


async def test_a_drain_moves_to_a_backend_with_room_when_there_is_one() -> None:
    async with fleet(LONG, LONG, LONG, policy={"name": MoveToOther.name},
                     flow_control=_limit(1), migration=NO_CHECKS) as (proxy, fakes):
        # long enough (2 s) to be running still when the drain comes, on a busy machine
        moving = await _stream(proxy, "a", DRAINED)  # f0
        other = await _stream(proxy, "b", DRAINED)  # f1 (the first with room)
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            drained = await http.post("/admin/backends/f0/drain", headers=ADMIN)
            assert drained.json()["moving"] == 1
        answers = [await moving, await other]
    assert [stream_text(a) for a in answers] == [expected_text(DRAINED)] * 2
    assert continuation_bodies(fakes[1]) == [] and len(continuation_bodies(fakes[2])) == 1


async def test_a_drain_moves_even_when_every_other_backend_is_full() -> None:
    async with fleet(LONG, LONG, policy={"name": MoveToOther.name},
                     flow_control=_limit(1), migration=NO_CHECKS) as (proxy, fakes):
        moving = await _stream(proxy, "a", DRAINED)
        other = await _stream(proxy, "b", DRAINED)
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            drained = await http.post("/admin/backends/f0/drain", headers=ADMIN)
            assert drained.json()["moving"] == 1
        answers = [await moving, await other]
    assert [stream_text(a) for a in answers] == [expected_text(DRAINED)] * 2
    assert len(continuation_bodies(fakes[1])) == 1  # one over the limit, nothing lost
