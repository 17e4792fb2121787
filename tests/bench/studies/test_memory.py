"""The memory benchmark's arithmetic and harness; one tiny run through the real proxy.

Asserts the harness measures and checks what it sends, not the proxy's memory targets.
"""

from __future__ import annotations

import asyncio
import os
import random

import aiohttp

from bench.fakes.fake_vllm import FakeConfig, serve_fake
from bench.studies.memory import (
    Plan,
    held_streams,
    metric_total,
    mixed_request,
    plain_stream,
    rss_kb,
    run,
    slope_per_1k,
    table,
    verdict,
    wave,
)


def test_slope_is_the_least_squares_growth_per_thousand_requests() -> None:
    assert slope_per_1k([1000, 2000, 3000], [500, 520, 540]) == 20.0
    assert slope_per_1k([1000, 2000, 3000, 4000], [500, 530, 510, 540]) == 10.0
    assert slope_per_1k([1000], [500]) == 0.0


def test_metric_totals_sum_over_labels() -> None:
    page = ('# TYPE laneway_migrations counter\nlaneway_migrations_total{reason="a"} 3.0\n'
            'laneway_migrations_total{reason="b"} 2.0\nlaneway_migrations_created 1.7e9\n'
            'laneway_client_disconnects_total 4.0\n')
    assert metric_total(page, "laneway_migrations_total") == 5.0
    assert metric_total(page, "laneway_client_disconnects_total") == 4.0
    assert metric_total(page, "laneway_nothing_total") == 0.0
    # with labels: the samples whose labels begin with them
    assert metric_total(page, "laneway_migrations_total", 'reason="b"') == 2.0
    assert metric_total(page, "laneway_migrations_total", 'reason="c"') == 0.0


def test_rss_is_read_from_proc() -> None:
    mine = rss_kb(os.getpid())
    assert 0 < mine["RssAnon"] <= mine["VmRSS"]


def test_the_mix_has_every_kind_in_its_share() -> None:
    rng = random.Random(0)
    kinds = [mixed_request(rng)[0] for _ in range(4000)]
    shares = {k: kinds.count(k) / len(kinds) for k in set(kinds)}
    expected = {"chat_stream": 0.4, "chat": 0.2, "completion_stream": 0.1, "migration": 0.1,
                "client_leaves": 0.1, "malformed": 0.05, "unknown_model": 0.05}
    assert set(shares) == set(expected)
    assert all(abs(shares[k] - v) < 0.03 for k, v in expected.items()), shares


async def test_a_wave_counts_wrong_answers_and_held_streams_are_all_open() -> None:
    async with serve_fake(FakeConfig(model="fast", aliases=("paced",), tpot_s=0.01)) as ok, \
            serve_fake(FakeConfig(model="fast", fail_status=503)) as failing, \
            aiohttp.ClientSession() as http:
        batch = [plain_stream(random.Random(n)) for n in range(12)]
        assert await wave(http, ok.url, batch, 4, 30) == {}
        assert await wave(http, failing.url, batch, 4, 30) == {
            'chat_stream: HTTP 503: {"error":{"message":"injected failure"}}': 12}
        held = await held_streams(http, ok.url, os.getpid(), "paced", 8, 30, 30)
        # streams refused before their first chunk are reported at once, not waited on
        # until the timeout (CI once waited 120 s on one the bare relay failed)
        refused = await asyncio.wait_for(
            held_streams(http, failing.url, os.getpid(), "fast", 8, 30, 30), 10)
    assert held["streams"] == 8 and held["failed_streams"] == 0 and held["tokens"] == 30
    assert held["rss_anon_kb_open"] > 0
    assert refused["failed_streams"] == 8
    assert refused["errors"] == ['HTTP 503: {"error":{"message":"injected failure"}}']


def test_a_tiny_run_through_laneway_serves_every_kind_as_expected() -> None:
    """Real processes: laneway in front of fakes, and the bare relays. Every kind of
    request (migrations, clients leaving, 400s, 404s) gets the answer it should."""
    plan = Plan(held=(("held", 16), ("paced", 16)), hold_s=0.6, held_tpot_ms=30, waves=2,
                wave_requests=150, warmup_waves=1, concurrency=16, frozen_moves=True)
    result = run(plan)
    for growth in (result["laneway"]["growth"], result["floor"]["growth"],
                   result["laneway_traced"]):
        assert growth["failures"] == {}
        assert growth["requests_after_wave"] == [150, 300]
        assert all(kb > 0 for kb in growth["kb_after_wave"])
    for system in ("laneway", "floor"):
        held = result[system]["open_streams"]
        assert [(r["model"], r["tokens"], r["failed_streams"]) for r in held] == [
            ("held", 20, 0), ("paced", 30, 0)]
    assert result["laneway"]["warmup_failures"] == {}
    # a tenth of the 200 warm-up and 300 wave requests each: ~50 moves (frozen: each one
    # completes however loaded the machine is), ~50 left
    assert result["laneway"]["migrations"] >= 25
    assert result["laneway"]["client_disconnects"] >= 25
    assert set(verdict(result)) == {"kb_per_open_stream", "growth_kb_per_1k_requests"}
    assert "per open stream, 16 open x 20 tokens (held)" in table(result)
