"""The `disco` policy on a device and a server backend: each strategy's pick, Algorithm
1's side, the per-request budget, the censored feedback and the migration check."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest

from policies.base import build_policy
from policies.disco import Disco
from policies.disco.cost import TokenCost, constrained_side, request_cost, resolve, unified
from proxy.types import NO_PREDICTION, Backend, Hedge, Outcome, Prediction, Progress
from tests.policies.helpers import ctx, view

DEVICE = Backend("phone", "http://phone", "m", MappingProxyType({"side": "device"}))
SERVER = Backend("cloud", "http://cloud", "m", MappingProxyType({"side": "server"}))
FLEET = view((DEVICE, SERVER))
SHORT, LONG = "word " * 10, "word " * 390


def disco(tmp_path: Path, **params: Any) -> Disco:
    prior = tmp_path / "ttft.json"
    prior.write_text(json.dumps(np.random.default_rng(0).exponential(0.5, 500).tolist()))
    policy = build_policy("disco", {"ttft_prior": str(prior), "seed": 1, **params})
    assert isinstance(policy, Disco)
    for words in range(5, 400, 5):  # p(l): prompts of 5..395 words
        policy.pick(ctx("w " * words), NO_PREDICTION, FLEET)
    policy.recompute()
    return policy


def test_algorithm_1_decides_the_constrained_side() -> None:
    server, joules = TokenCost(0.15, 0.60), TokenCost(0.16, 0.36)
    assert constrained_side(unified(server, joules, 5.0)) == "device"  # 0.8 > 0.6
    assert constrained_side(unified(server, joules, 0.3)) == "server"  # 0.048 < 0.6
    assert resolve("auto", server, joules, None)[0] == "device"  # λ = 5 agrees with itself
    assert resolve("auto", server, TokenCost(0.01, 0.01), None)[0] == "server"
    side, costs = resolve("server", server, joules, 5.0)  # the override beats Algorithm 1
    assert side == "server" and costs.device.decode == pytest.approx(1.8)
    cost = request_cost(costs, {"server": 100, "device": 100}, {"device": 10})
    assert cost == pytest.approx((0.15 * 100 + 0.8 * 100 + 1.8 * 10) / 1e6)


def test_mode_auto_follows_algorithm_1_on_the_backends_prices(tmp_path: Path) -> None:
    # default prices at λ = 5: the device's cheapest token (0.8 $/1M) beats the
    # server's dearest (0.6): device-constrained, the server leads
    assert disco(tmp_path).pick(ctx(LONG), NO_PREDICTION, FLEET).backend == SERVER
    frugal = Backend("frugal", "http://frugal", "m", MappingProxyType(
        {"side": "device", "cost_prefill": "0.01", "cost_decode": "0.01"}))
    policy = disco(tmp_path)  # 0.05 $/1M at λ = 5: server-constrained, the device leads
    assert policy.pick(ctx(LONG), NO_PREDICTION, view((frugal, SERVER))).backend == frugal
    forced = disco(tmp_path, mode="device")
    assert forced.pick(ctx(LONG), NO_PREDICTION, view((frugal, SERVER))).backend == SERVER


def test_baselines_use_one_side(tmp_path: Path) -> None:
    for strategy, backend in (("server_only", SERVER), ("device_only", DEVICE)):
        decision = disco(tmp_path, strategy=strategy).pick(ctx(LONG), NO_PREDICTION, FLEET)
        assert decision.backend == backend and decision.hedge is None


def test_disco_d_hedges_the_device_after_the_tables_wait(tmp_path: Path) -> None:
    policy = disco(tmp_path, mode="auto", exchange_rate=5.0, budget=0.3, tail_ratio=0.05)
    table = policy.wait_table()
    short = policy.pick(ctx(SHORT), NO_PREDICTION, FLEET)
    long = policy.pick(ctx(LONG), NO_PREDICTION, FLEET)
    assert short.backend == SERVER and short.hedge == Hedge(DEVICE, 0.0)
    assert long.backend == SERVER and long.hedge == Hedge(DEVICE, table.w_tail)
    assert table.w_tail > 0.0
    nothing = policy.decide(ctx(LONG), FLEET, budget=0.0)  # the per-request override
    assert nothing.backend == SERVER and nothing.hedge is None


def test_disco_s_races_only_the_long_prompts(tmp_path: Path) -> None:
    policy = disco(tmp_path, mode="auto", exchange_rate=0.3, budget=0.3)
    short = policy.pick(ctx(SHORT), NO_PREDICTION, FLEET)
    long = policy.pick(ctx(LONG), NO_PREDICTION, FLEET)
    assert short.backend == DEVICE and short.hedge is None
    assert long.backend == DEVICE and long.hedge == Hedge(SERVER, 0.0)
    everything = policy.decide(ctx(SHORT), FLEET, budget=1.0)
    assert everything.hedge == Hedge(SERVER, 0.0)
    asked = dataclasses.replace(ctx(SHORT), budget=1.0)  # the client's x-laneway-budget
    assert policy.pick(asked, NO_PREDICTION, FLEET).hedge == Hedge(SERVER, 0.0)


@pytest.mark.parametrize(("mode", "primary", "hedged"), [("device", SERVER, DEVICE),
                                                          ("server", DEVICE, SERVER)])
def test_stoch_races_a_random_share_b(tmp_path: Path, mode: str, primary: Backend,
                                      hedged: Backend) -> None:
    policy = disco(tmp_path, strategy="stoch", mode=mode, budget=0.25)
    picks = [policy.pick(ctx(SHORT), NO_PREDICTION, FLEET) for _ in range(4000)]
    assert all(p.backend == primary for p in picks)
    raced = [p.hedge for p in picks if p.hedge is not None]
    assert all(h == Hedge(hedged, 0.0) for h in raced)
    assert len(raced) / len(picks) == pytest.approx(0.25, abs=0.03)


def test_no_device_candidate_or_no_labels_goes_to_the_server(tmp_path: Path) -> None:
    policy = disco(tmp_path)
    assert policy.pick(ctx(LONG), NO_PREDICTION, view((SERVER,))).hedge is None
    plain = Backend("plain", "http://plain", "m")
    assert policy.pick(ctx(LONG), NO_PREDICTION, view((plain,))).backend == plain


def outcome(backend: str, status: int, ttft_s: float | None, e2e_s: float) -> Outcome:
    return Outcome(request_id="r", model="m", backend=backend, policy="disco",
                   status=status, ok=status == 200, started_at=0.0, ttft_s=ttft_s,
                   e2e_s=e2e_s, completion_tokens=0, prompt_tokens=50)


def test_a_lost_server_leg_is_censored_not_dropped(tmp_path: Path) -> None:
    dropped = disco(tmp_path, exchange_rate=5.0, recompute_every=10, ttft_window=510,
                    recompute_interval_s=0)
    censored = disco(tmp_path, exchange_rate=5.0, recompute_every=10, ttft_window=510,
                     recompute_interval_s=0)
    before = censored.wait_table().w_tail
    for _ in range(10):  # aborted at 0.3 s: only known to be slower than that
        censored.observe(outcome("cloud", 499, None, 0.3))
        dropped.observe(outcome("cloud", 502, None, 0.3))
    assert dropped.wait_table().w_tail == before
    assert censored.wait_table().w_tail > before  # more mass beyond 0.3 s


def test_migration_waits_for_the_readers_buffer(tmp_path: Path) -> None:
    policy = disco(tmp_path, exchange_rate=5.0, read_rate=5.0)
    request, pred = ctx(SHORT, max_tokens=None), Prediction(output_tokens=500.0)
    t_m = policy.server_ttft().quantile(0.9)  # the server's TTFT q90 (the default)
    needed = math.ceil(5.0 * t_m)
    early = Progress(DEVICE, generated=needed, max_tokens=None, elapsed_s=1.0,
                     ttft_s=1.0, tpot_s=0.07, migrations=0)  # 1 read, needed - 1 held
    ready = Progress(DEVICE, generated=needed + 1, max_tokens=None, elapsed_s=1.0,
                     ttft_s=1.0, tpot_s=0.07, migrations=0)
    others = view((SERVER,))
    assert policy.reroute(request, pred, early, others) is None
    moved = policy.reroute(request, pred, ready, others)
    assert moved is not None and moved.backend == SERVER
    machine = dataclasses.replace(request, read_rate=0.0)  # x-laneway-read-rate: 0
    assert policy.reroute(machine, pred, early, others) is not None  # no buffer to fill
    off = disco(tmp_path, exchange_rate=5.0, migration=False)
    assert off.reroute(request, pred, ready, others) is None
    # the server decodes cheaper than the device: never back to the device
    assert policy.reroute(request, pred, Progress(
        SERVER, 50, None, 1.0, 0.2, 0.02, 0), view((DEVICE,))) is None
