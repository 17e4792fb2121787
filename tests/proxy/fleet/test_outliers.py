"""Passive health (proxy/fleet/outliers.py): the counting and the ejection's length, on a
test clock; the poller keeping an ejected backend out; and the proxy in front of fake
backends that fail what they are sent while their /metrics answer."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx
import pytest

from bench.fakes.fake_vllm import FakeConfig
from proxy.config import OutliersConfig, PollerConfig
from proxy.fleet.outliers import Outliers
from proxy.fleet.poller import Poller
from proxy.fleet.registry import Registry
from proxy.types import Backend
from tests.proxy.fakes import ADMIN, CHAT, fleet, post
from tests.proxy.fleet.test_poller import MetricsServer, serving


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def outliers(models: dict[str, list[str]] | None = None, **cfg: float
             ) -> tuple[Outliers, Clock, list[tuple[str, float]]]:
    """Outliers on a test clock; `models`: the backends of each model (by default each
    backend is its model's only one)."""
    clock, ejected = Clock(), []
    config = OutliersConfig(**cfg)  # type: ignore[arg-type]

    def peers(backend: str) -> list[str]:
        return next((names for names in (models or {}).values() if backend in names),
                    [backend])

    made = Outliers(lambda: config, lambda name, for_s: ejected.append((name, for_s)),
                    peers, clock)
    return made, clock, ejected


def attempts(o: Outliers, backend: str, n: int, fail: bool) -> None:
    for _ in range(n):
        o.sent(backend)
        if fail:
            o.failed(backend, "status")


def test_ejects_after_enough_failures_that_are_most_of_the_attempts() -> None:
    o, clock, ejected = outliers()
    attempts(o, "a", 4, fail=True)
    attempts(o, "b", 20, fail=False)
    assert ejected == [] and o.ejected_for("a") == 0.0
    attempts(o, "a", 1, fail=True)
    assert ejected == [("a", 30.0)] and o.ejected_for("a") == 30.0
    clock.now += 10
    assert o.ejected_for("a") == 20.0 and o.ejected_for("b") == 0.0
    attempts(o, "a", 10, fail=True)  # its open requests failing over: not counted
    assert ejected == [("a", 30.0)] and o.ejections == 1


def test_a_busy_backend_with_a_few_failures_stays() -> None:
    o, _, ejected = outliers()
    for _ in range(8):  # 8 failures among 24 attempts: a third, under the ratio
        attempts(o, "a", 2, fail=False)
        attempts(o, "a", 1, fail=True)
    assert ejected == []
    attempts(o, "a", 7, fail=True)  # 15 of 31: still under half
    assert ejected == []
    attempts(o, "a", 1, fail=True)  # 16 of 32
    assert ejected == [("a", 30.0)]


def test_failures_older_than_the_window_do_not_count() -> None:
    o, clock, ejected = outliers(window_s=10.0)
    attempts(o, "a", 4, fail=True)
    clock.now += 10.5  # every slice of those four is out of the window
    attempts(o, "a", 4, fail=True)
    assert ejected == []
    clock.now += 5  # the second four are still in it
    attempts(o, "a", 1, fail=True)
    assert ejected == [("a", 30.0)]


def test_ejections_in_a_row_double_up_to_the_longest_then_start_again() -> None:
    o, clock, ejected = outliers(eject_s=30.0, max_eject_s=100.0)
    for _ in range(4):
        attempts(o, "a", 5, fail=True)
        clock.now += o.ejected_for("a") + 1  # back, and failing again at once
    assert [for_s for _, for_s in ejected] == [30.0, 60.0, 100.0, 100.0]
    for _ in range(2000):  # flapping for days: still the longest, no overflow
        attempts(o, "a", 5, fail=True)
        clock.now += o.ejected_for("a") + 1
    assert ejected[-1] == ("a", 100.0) and o.ejections == 2004
    clock.now += 101  # a longer good spell than the longest ejection
    attempts(o, "a", 5, fail=True)
    assert ejected[-1] == ("a", 30.0)


def test_a_returned_backend_starts_with_a_fresh_count() -> None:
    o, clock, ejected = outliers()
    attempts(o, "a", 5, fail=True)
    clock.now += 31
    attempts(o, "a", 4, fail=True)
    assert len(ejected) == 1


def test_off_with_failures_zero_and_forget() -> None:
    o, _, ejected = outliers(failures=0)
    attempts(o, "a", 50, fail=True)
    assert ejected == [] and o.ejected_for("a") == 0.0
    o, _, ejected = outliers()
    attempts(o, "a", 5, fail=True)
    o.forget("a")
    assert o.ejected_for("a") == 0.0


async def test_the_poller_keeps_an_ejected_backend_out_until_the_ejection_ends(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr("proxy.fleet.poller.time.monotonic", lambda: clock[0])
    async with serving(MetricsServer()) as (_, url):
        registry = Registry([Backend("a", url, "m")])
        poller = Poller(registry, PollerConfig(interval_s=0.01, timeout_s=0.5))
        try:
            await poller.poll_once()
            assert registry.stats["a"].healthy
            poller.eject("a", 30.0)
            assert not registry.stats["a"].healthy
            clock[0] += 10
            await poller.poll_once()  # not due: nothing scraped
            assert not registry.stats["a"].healthy
            poller._health["a"].next_probe_at = 0.0  # a scrape already under way
            await poller.poll_once()
            assert not registry.stats["a"].healthy and registry.stats["a"].running == 2
            assert poller._health["a"].next_probe_at == 130.0
            clock[0] += 21
            await poller.poll_once()
            assert registry.stats["a"].healthy
        finally:
            await poller.scraper.close()


async def metric(proxy_url: str, name: str, backend: str) -> float:
    async with httpx.AsyncClient(base_url=proxy_url, timeout=10) as http:
        text = (await http.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith(f'{name}{{backend="{backend}"') and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def admin_backend(proxy_url: str, name: str) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=proxy_url, timeout=10) as http:
        listed = (await http.get("/admin/backends", headers=ADMIN)).json()["backends"]
    return next(b for b in listed if b["name"] == name)  # type: ignore[no-any-return]


@pytest.mark.parametrize("broken", [FakeConfig(fail_status=500),
                                    FakeConfig(die_after_tokens=3)],
                         ids=["5xx", "stream-cut"])
async def test_a_backend_that_fails_every_request_is_ejected_then_tried_again(
    broken: FakeConfig
) -> None:
    # the ejection outlasts the requests made during it on a slow machine too (a CI
    # machine took ~0.1 s a request, and a 1 s ejection ended within the loop)
    outliers_cfg = {"failures": 3, "eject_s": 3.0, "window_s": 30.0}
    async with fleet(broken, FakeConfig(), outliers=outliers_cfg,
                     poller={"interval_s": 0.02}) as (proxy, fakes):
        bad, good = fakes[0].app.stats, fakes[1].app.stats
        stream = {**CHAT, "stream": True, "max_tokens": 8}

        async def six_whole_answers() -> None:
            for _ in range(6):  # round robin: every other one is f0's while it is in
                answer = await post(proxy, stream)
                assert answer.status_code == 200 and "data: [DONE]" in answer.text
                assert "error" not in answer.text

        await six_whole_answers()  # f0 fails three of them, each answered by f1
        assert await metric(proxy.url, "laneway_backend_ejections_total", "f0") == 1.0
        tried = bad.requests
        assert tried == 3  # its third failure ejected it
        await six_whole_answers()
        assert bad.requests == tried  # nothing more went there while it was out
        described = await admin_backend(proxy.url, "f0")
        assert described["healthy"] is False and 0 < described["ejected_for_s"] <= 3.0
        assert good.requests >= 12
        deadline = time.monotonic() + 10
        while not (await admin_backend(proxy.url, "f0"))["healthy"]:
            assert time.monotonic() < deadline, "the ejection never ended"
            await asyncio.sleep(0.05)
        await six_whole_answers()
        assert bad.requests == 2 * tried  # back in the rotation, failing, and out again
        assert await metric(proxy.url, "laneway_backend_ejections_total", "f0") == 2.0
        assert 3.0 < (await admin_backend(proxy.url, "f0"))["ejected_for_s"] <= 6.0


def test_at_most_max_ejection_percent_of_a_models_backends_are_out() -> None:
    """Requests that fail on every backend (a poison prompt) count against each of
    them: at 10 % only one of a model's three is out at a time, the next one due goes
    when it comes back; other models' backends are counted apart."""
    models = {"m": ["a", "b", "c"], "n": ["x"]}
    o, clock, ejected = outliers(models, eject_s=10.0, window_s=60.0)
    for backend in ("a", "b", "c", "x"):
        attempts(o, backend, 5, fail=True)
    assert ejected == [("a", 10.0), ("x", 10.0)]
    assert o.ejected_for("b") == o.ejected_for("c") == 0.0
    clock.now += 10.5  # a's ejection over: b, still failing, goes at its next failure
    attempts(o, "c", 1, fail=False)  # (an attempt that does not fail: no evaluation)
    assert ejected == [("a", 10.0), ("x", 10.0)]
    attempts(o, "b", 1, fail=True)
    assert ejected[-1] == ("b", 10.0)
    attempts(o, "c", 1, fail=True)  # b is out now
    assert len(ejected) == 3


@pytest.mark.parametrize(("percent", "out"), [(0.0, 1), (10.0, 1), (50.0, 2), (100.0, 4)])
def test_the_bound_is_a_share_of_the_models_backends_and_at_least_one(
        percent: float, out: int) -> None:
    o, _, ejected = outliers({"m": ["a", "b", "c", "d"]}, max_ejection_percent=percent)
    for backend in ("a", "b", "c", "d"):
        attempts(o, backend, 5, fail=True)
    assert len(ejected) == out


def test_a_held_backend_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    o, _, _ = outliers({"m": ["a", "b"]})
    attempts(o, "a", 5, fail=True)
    attempts(o, "b", 8, fail=True)
    held = [r.getMessage() for r in caplog.records if "not ejected" in r.getMessage()]
    assert held == ["backend b not ejected, though it fails: 1 of the 2 backends of its "
                    "model are out already (a; outliers.max_ejection_percent 10)"]


async def test_requests_failing_on_every_backend_take_out_only_one(
        caplog: pytest.LogCaptureFixture) -> None:
    """What a prompt that crashes every vLLM does, sent again and again: each attempt
    fails, on every backend in turn. With the default bound (10 % of a model's
    backends, at least one) one of the three is ejected and the other two stay."""
    broken = FakeConfig(fail_status=500)
    async with fleet(broken, broken, broken, outliers={"failures": 3},
                     poller={"interval_s": 0.02}) as (proxy, fakes):
        for _ in range(6):
            answer = await post(proxy, CHAT)
            assert answer.status_code >= 500  # no backend could answer it
        assert all(f.app.stats.requests >= 3 for f in fakes)  # each failed it
        healthy = [(await admin_backend(proxy.url, f"f{i}"))["healthy"] for i in range(3)]
        ejections = [await metric(proxy.url, "laneway_backend_ejections_total", f"f{i}")
                     for i in range(3)]
    assert sorted(healthy) == [False, True, True] and sorted(ejections) == [0, 0, 1]
    held = {r.getMessage().split()[1] for r in caplog.records
            if "not ejected" in r.getMessage()}
    assert len(held) == 2 and healthy[int(held.pop()[1])] is True


def test_refused_connections_are_attempts_but_not_failures() -> None:
    o, _, ejected = outliers()
    for _ in range(10):
        o.sent("a")
        o.failed("a", "connect")
    assert ejected == []
    kinds = ["timeout", "broken", "error", "status", "malformed"] * 2
    for n, kind in enumerate(kinds, 1):
        o.sent("a")
        o.failed("a", kind)
        assert (ejected == [("a", 30.0)]) == (n == 10)  # 10 of 20: half


async def test_undrain_ends_an_ejection_for_a_mended_backend() -> None:
    async with fleet(FakeConfig(fail_status=500), FakeConfig(),
                     outliers={"failures": 2, "eject_s": 300.0},
                     poller={"interval_s": 0.02}) as (proxy, fakes):
        for _ in range(6):
            assert (await post(proxy, CHAT)).status_code == 200
        assert (await admin_backend(proxy.url, "f0"))["ejected_for_s"] > 200
        fakes[0].app.config = dataclasses.replace(fakes[0].app.config, fail_status=None)
        async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as http:
            undrained = (await http.post("/admin/backends/f0/undrain", headers=ADMIN)).json()
            again = (await http.post("/admin/backends/f0/undrain", headers=ADMIN)).json()
        assert undrained == {"backend": "f0", "draining": False, "ejection_ended": True}
        assert again["ejection_ended"] is False
        deadline = time.monotonic() + 5
        while not (await admin_backend(proxy.url, "f0"))["healthy"]:
            assert time.monotonic() < deadline, "not back after its ejection ended"
            await asyncio.sleep(0.02)
        answers = [await post(proxy, CHAT) for _ in range(4)]
        assert [a.headers["x-laneway-backend"] for a in answers].count("f0") == 2
        assert all(a.status_code == 200 for a in answers)
