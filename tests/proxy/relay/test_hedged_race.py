"""A policy's hedged race on the request path (proxy/relay/race.py): the first leg at
once, the hedge after its delay unless the first has a token; the first token wins,
the loser is aborted and observed as a censored 499."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import httpx
import pytest
from pydantic import BaseModel

from bench.fakes.fake_vllm import FakeConfig, RunningFake
from policies.base import PARAMS_CONFIG, POLICIES, register
from policies.disco import Disco
from proxy.relay.race import _ends_wait
from proxy.types import ClusterView, Decision, Hedge, Outcome, Prediction, RequestContext
from tests.proxy.fakes import CHAT, events, fleet, post


class HedgeParams(BaseModel):
    model_config = PARAMS_CONFIG
    delay_s: float = 0.0


class HedgeToSecond:
    """A test policy: f0 first, f1 as the hedge after `delay_s`; keeps every outcome."""

    name: ClassVar[str] = "test_hedge_to_second"
    Params: ClassVar[type[BaseModel]] = HedgeParams

    def __init__(self, params: HedgeParams) -> None:
        self.delay_s = params.delay_s
        self.outcomes: list[Outcome] = []

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        by_name = {b.name: b for b in view.candidates}
        if "f0" not in by_name or "f1" not in by_name:
            return Decision(view.candidates[0], "alone")
        return Decision(by_name["f0"], "race", hedge=Hedge(by_name["f1"], self.delay_s))

    def observe(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


if HedgeToSecond.name not in POLICIES:
    register(HedgeToSecond)


def policy_of(proxy: Any) -> Any:
    return proxy.app.runtime.router.policy


async def settled(fake: RunningFake) -> None:
    """Until the fake runs nothing (an aborted request leaves when it sees the close)."""
    for _ in range(500):
        if fake.app.stats.running == 0 and fake.app.stats.waiting == 0:
            return
        await asyncio.sleep(0.01)


def label(runtime: Any, labels: dict[str, dict[str, str]]) -> None:
    """Give the running proxy's backends these labels (DiSCo's `side`, prices)."""
    for name, wanted in labels.items():
        backend = runtime.registry.remove(name)
        runtime.registry.add(dataclasses.replace(backend, labels=MappingProxyType(wanted)))
    runtime.registry.publish(runtime.registry.stats)


def text_of(response: httpx.Response) -> str:
    parts = []
    for payload in events(response.text):
        if payload != "[DONE]":
            for choice in json.loads(payload).get("choices", ()):
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


STREAM = {**CHAT, "stream": True, "max_tokens": 6}
EXPECTED = "tok0 tok1 tok2 tok3 tok4 tok5 "


@pytest.mark.parametrize("slow", ["f0", "f1"])
async def test_the_first_token_wins_and_the_loser_is_aborted(slow: str) -> None:
    configs = {name: FakeConfig(ttft_s=5.0 if name == slow else 0.0, tpot_s=0.001)
               for name in ("f0", "f1")}
    async with fleet(configs["f0"], configs["f1"],
                     policy={"name": HedgeToSecond.name, "params": {"delay_s": 0.0}}
                     ) as (proxy, fakes):
        response = await post(proxy, STREAM)
        for fake in fakes:
            await settled(fake)
        inflight = dict(proxy.app.runtime.registry.local_inflight)  # type: ignore[union-attr]
        outcomes = list(policy_of(proxy).outcomes)
        metrics = (await httpx.AsyncClient().get(f"{proxy.url}/metrics")).text
    fast = "f1" if slow == "f0" else "f0"
    assert response.status_code == 200
    assert response.headers["x-laneway-backend"] == fast
    assert text_of(response) == EXPECTED
    loser = fakes[int(slow[1])].app.stats
    assert loser.requests == 1 and loser.cancelled == 1 and loser.finished == 0
    assert fakes[int(fast[1])].app.stats.finished == 1
    assert inflight == {"f0": 0, "f1": 0}
    by_backend = {o.backend: o for o in outcomes}
    assert len(outcomes) == 2
    lost, won = by_backend[slow], by_backend[fast]
    assert (lost.status, lost.ttft_s, lost.ok) == (499, None, False)  # censored
    assert 0.0 < lost.e2e_s < 5.0  # it ran until aborted, not to its token
    assert won.ok and won.ttft_s is not None and won.completion_tokens == 6
    leg = "hedge" if fast == "f1" else "first"
    assert f'laneway_race_wins_total{{hedge_opened="yes",leg="{leg}",side="server"}} 1.0' \
        in metrics


async def test_a_token_before_the_delay_never_opens_the_hedge() -> None:
    async with fleet(FakeConfig(), FakeConfig(),
                     policy={"name": HedgeToSecond.name, "params": {"delay_s": 30.0}}
                     ) as (proxy, fakes):
        response = await post(proxy, STREAM)
        whole = await post(proxy, {**CHAT, "max_tokens": 3})  # not streamed: the answer
        outcomes = list(policy_of(proxy).outcomes)
    assert response.headers["x-laneway-backend"] == "f0" and text_of(response) == EXPECTED
    assert whole.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
    assert fakes[1].app.stats.requests == 0
    assert [o.backend for o in outcomes] == ["f0", "f0"] and all(o.ok for o in outcomes)


@pytest.mark.parametrize("failure", [{"fail_status": 503}, {"die_after_tokens": 0}])
async def test_a_leg_failing_before_its_token_lets_the_other_continue(
        failure: dict[str, Any]) -> None:
    # the hedge waits 30 s: it opens at once because the first leg failed
    async with fleet(FakeConfig(**failure), FakeConfig(),
                     policy={"name": HedgeToSecond.name, "params": {"delay_s": 30.0}}
                     ) as (proxy, _):
        response = await post(proxy, STREAM)
        outcomes = list(policy_of(proxy).outcomes)
    assert response.status_code == 200 and response.headers["x-laneway-backend"] == "f1"
    assert text_of(response) == EXPECTED
    failed, won = outcomes
    assert (failed.backend, failed.status, won.backend, won.ok) == ("f0", 502, "f1", True)


async def test_the_hedge_failing_lets_the_slow_first_leg_win() -> None:
    async with fleet(FakeConfig(ttft_s=0.3), FakeConfig(fail_status=503),
                     policy={"name": HedgeToSecond.name, "params": {"delay_s": 0.0}}
                     ) as (proxy, _):
        response = await post(proxy, STREAM)
        outcomes = sorted(policy_of(proxy).outcomes, key=lambda o: o.backend)
    assert response.headers["x-laneway-backend"] == "f0" and text_of(response) == EXPECTED
    assert [(o.backend, o.status) for o in outcomes] == [("f0", 200), ("f1", 502)]


async def test_both_legs_failing_is_the_usual_error() -> None:
    async with fleet(FakeConfig(fail_status=503), FakeConfig(fail_status=503),
                     policy={"name": HedgeToSecond.name, "params": {"delay_s": 0.0}},
                     upstream={"max_attempts": 1, "retry_window_s": 0}) as (proxy, _):
        response = await post(proxy, STREAM)
        inflight = dict(proxy.app.runtime.registry.local_inflight)  # type: ignore[union-attr]
    assert response.status_code == 502
    assert inflight == {"f0": 0, "f1": 0}


async def test_a_hedge_whose_backend_filled_up_is_not_opened() -> None:
    """Flow control: f1 had room at the pick; when the hedge's delay is over it is
    full, so the hedge stays closed and the slow first leg answers."""
    async with fleet(FakeConfig(ttft_s=2.0), FakeConfig(),
                     policy={"name": HedgeToSecond.name, "params": {"delay_s": 1.0}},
                     flow_control={"max_inflight_per_backend": 1}) as (proxy, fakes):
        runtime = proxy.app.runtime
        assert runtime is not None
        request = asyncio.create_task(post(proxy, STREAM))
        for _ in range(500):  # until the pick sent the first leg
            if fakes[0].app.stats.requests:
                break
            await asyncio.sleep(0.01)
        with runtime.registry.guard("f1"):  # another request fills f1
            response = await request
        inflight = dict(runtime.registry.local_inflight)
    assert response.headers["x-laneway-backend"] == "f0" and text_of(response) == EXPECTED
    assert fakes[1].app.stats.requests == 0
    assert inflight == {"f0": 0, "f1": 0}


def test_the_role_chunk_is_not_a_token() -> None:
    role = b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""},' \
        b'"logprobs":null,"finish_reason":null}]}'
    token = b'{"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}'
    assert not _ends_wait(role, chat=True)
    assert _ends_wait(token, chat=True)
    assert _ends_wait(b'{"error":{"message":"x"}}', chat=True)
    assert _ends_wait(b"[DONE]", chat=True)


async def test_disco_learns_the_lost_server_leg_as_censored(tmp_path: Path) -> None:
    """DiSCo-S at budget 1 races every prompt: the device (f0) leads, the server (f1,
    slow) hedges at 0 and loses; its TTFT window gets a censored sample."""
    prior = tmp_path / "ttft.json"
    prior.write_text(json.dumps([0.1] * 30))
    params = {"mode": "server", "budget": 1.0, "ttft_prior": str(prior), "migration": False,
              "recompute_every": 1, "recompute_interval_s": 0}  # (in observe: the first
    # request's length makes the race table for the second)
    async with fleet(FakeConfig(), FakeConfig(ttft_s=5.0),
                     policy={"name": "disco", "params": params}) as (proxy, fakes):
        runtime = proxy.app.runtime
        assert runtime is not None
        label(runtime, {"f0": {"side": "device", "cost_prefill": "0.5", "cost_decode": "2"},
                        "f1": {"side": "server"}})
        alone = await post(proxy, STREAM)  # p(l) is empty: the device alone
        response = await post(proxy, STREAM)
        await settled(fakes[1])
        policy = runtime.router.policy
        metrics = (await httpx.AsyncClient().get(f"{proxy.url}/metrics")).text
    assert isinstance(policy, Disco)
    assert alone.headers["x-laneway-backend"] == "f0"
    assert response.headers["x-laneway-backend"] == "f0" and text_of(response) == EXPECTED
    assert fakes[1].app.stats.requests == fakes[1].app.stats.cancelled == 1
    prompt = fakes[0].app.stats.prompt_tokens // 2  # (two requests of one prompt)
    for line in [
            'laneway_side_decisions_total{first="device",hedge="none",policy="disco"} 1.0',
            'laneway_side_decisions_total{first="device",hedge="server",policy="disco"} 1.0',
            'laneway_race_wins_total{hedge_opened="yes",leg="first",side="device"} 1.0',
            f'laneway_side_prompt_tokens_total{{side="device"}} {2.0 * prompt}',
            f'laneway_side_prompt_tokens_total{{side="server"}} {1.0 * prompt}',
            f'laneway_cost_units_total{{backend="f0",phase="prefill"}} {2 * prompt * 0.5}',
            'laneway_cost_units_total{backend="f0",phase="decode"} 24.0']:  # 12 tokens at 2
        assert line in metrics
    window = policy._ttft  # (the policy's own F window: the prior, then the lost leg)
    assert len(window) == 31 and list(window._censored)[-1] is True


async def test_a_bad_budget_header_is_a_clear_400() -> None:
    async with fleet(FakeConfig(), policy={"name": "disco"}) as (proxy, fakes):
        bad = await post(proxy, STREAM, headers={"x-laneway-budget": "2"})
        good = await post(proxy, STREAM, headers={"x-laneway-budget": "0.5",
                                                  "x-laneway-read-rate": "8"})
    assert bad.status_code == 400 and "x-laneway-budget" in bad.json()["error"]["message"]
    assert good.status_code == 200 and fakes[0].app.stats.requests == 1


async def test_disco_moves_a_won_server_stream_to_the_cheaper_device() -> None:
    """DiSCo-S end to end with migration (the existing reroute seam): the server (f1,
    fast) wins the race against the device (f0); the server's decode is dearer, and a
    machine reader (x-laneway-read-rate: 0) needs no buffer, so at the first τ check
    the stream moves to the device; the client sees one whole answer."""
    params = {"mode": "server", "budget": 1.0, "recompute_every": 1,
              "recompute_interval_s": 0}
    async with fleet(FakeConfig(ttft_s=0.2, tpot_s=0.005), FakeConfig(tpot_s=0.03),
                     policy={"name": "disco", "params": params},
                     migration={"check_every_tokens": 4}) as (proxy, fakes):
        runtime = proxy.app.runtime
        assert runtime is not None
        label(runtime, {"f0": {"side": "device"}, "f1": {"side": "server"}})
        body = {**CHAT, "stream": True, "max_tokens": 40}
        await post(proxy, {**body, "max_tokens": 1})  # p(l) learns the prompt
        response = await post(proxy, body, headers={"x-laneway-read-rate": "0"})
        metrics = (await httpx.AsyncClient().get(f"{proxy.url}/metrics")).text
    assert response.headers["x-laneway-backend"] == "f1"  # the race's winner
    assert text_of(response) == "".join(f"tok{i} " for i in range(40))
    assert 'laneway_race_wins_total{hedge_opened="yes",leg="hedge",side="server"} 1.0' \
        in metrics
    assert 'laneway_migrations_total{reason="policy",source="f1",target="f0"} 1.0' in metrics
    continued = [b for b in fakes[0].app.stats.bodies
                 if isinstance(b.get("prompt"), list) and b.get("stream")]
    assert len(continued) == 1  # the device continued it from the server's tokens
