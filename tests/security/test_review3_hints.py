"""Third review of #71: with `auth` on, a tenant's routing hints are honoured only for
keys allowed them (`auth.keys[].hints`). The headers `x-laneway-budget`,
`x-laneway-read-rate`, `x-laneway-slo-ms` and `x-laneway-expected-tokens` were read
from every request: a tenant could raise DiSCo's budget to 1 and have every prompt
raced on a second, paid endpoint (the operator's cost), or tighten its own SLO to be
placed ahead of the others (goodput). As `x-laneway-priority` already was, they are
the client's to set only with `auth` off, or a key's marked `hints: true`.

In process (tests/proxy/fakes.py): DiSCo-S at budget 0 sends every prompt to the
device alone; a budget of 1 races it on the server too, which the server fake counts."""

from __future__ import annotations

from typing import Any

import pytest

from bench.fakes.fake_vllm import FakeConfig
from proxy.hashing import hash_key
from tests.proxy.fakes import CHAT, fleet, post
from tests.proxy.relay.test_hedged_race import label, settled

STREAM = {**CHAT, "stream": True}
RACE_ALL = {"x-laneway-budget": "1"}
KEYS = [{"name": "plain", "sha256": hash_key("sk-plain")},
        {"name": "trusted", "sha256": hash_key("sk-trusted"), "hints": True}]


async def _server_legs(key: str | None, auth: dict[str, Any]) -> int:
    """How many legs reach the server when `key` asks for a budget of 1 (twice: the
    first teaches DiSCo the prompt length)."""
    params = {"mode": "server", "budget": 0.0, "recompute_every": 1,
              "recompute_interval_s": 0}
    headers = RACE_ALL | ({"authorization": f"Bearer {key}"} if key else {})
    async with fleet(FakeConfig(), FakeConfig(ttft_s=5.0), auth=auth,
                     policy={"name": "disco", "params": params}) as (proxy, fakes):
        runtime = proxy.app.runtime
        assert runtime is not None
        label(runtime, {"f0": {"side": "device"}, "f1": {"side": "server"}})
        for _ in range(2):
            answer = await post(proxy, STREAM, headers=headers)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-laneway-backend"] == "f0"
        await settled(fakes[1])
        return fakes[1].app.stats.requests


async def test_a_key_without_hints_cannot_raise_the_budget() -> None:
    assert await _server_legs("sk-plain", {"enabled": True, "keys": KEYS}) == 0


@pytest.mark.parametrize(("key", "auth"), [
    ("sk-trusted", {"enabled": True, "keys": KEYS}),  # a key allowed hints
    (None, {"enabled": False}),  # auth off: the client is trusted, as before
])
async def test_hints_still_work_where_allowed(key: str | None, auth: dict[str, Any]) -> None:
    assert await _server_legs(key, auth) == 1  # the second prompt raced on the server
