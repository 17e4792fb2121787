"""The runtime's background task that rebuilds a policy's tables (DiSCo's)."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from pydantic import BaseModel

from bench.fakes.fake_vllm import FakeConfig
from policies.base import PARAMS_CONFIG, POLICIES, register
from proxy.routing.recompute import recompute_tables
from proxy.types import ClusterView, Decision, Outcome, Prediction, RequestContext
from tests.proxy.fakes import CHAT, fleet, post


class EveryParams(BaseModel):
    model_config = PARAMS_CONFIG
    every_s: float = 0.01
    fail_first: bool = False


class CountsRecomputes:
    """A test policy with tables: counts its recomputes (the first may fail)."""

    name: ClassVar[str] = "test_counts_recomputes"
    Params: ClassVar[type[BaseModel]] = EveryParams

    def __init__(self, params: EveryParams) -> None:
        self.params = params
        self.recomputes = 0

    @property
    def recompute_interval_s(self) -> float:
        return self.params.every_s

    def recompute(self) -> None:
        self.recomputes += 1
        if self.params.fail_first and self.recomputes == 1:
            raise ValueError("a table that cannot be built")

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        return Decision(view.candidates[0], "first")

    def observe(self, outcome: Outcome) -> None:
        pass


if CountsRecomputes.name not in POLICIES:
    register(CountsRecomputes)


async def until(check: object, attempts: int = 500) -> None:
    for _ in range(attempts):
        if callable(check) and check():
            return
        await asyncio.sleep(0.01)


async def test_the_runtime_recomputes_in_the_background_and_stops_with_it() -> None:
    async with fleet(FakeConfig(), policy={"name": CountsRecomputes.name}) as (proxy, _):
        assert (await post(proxy, CHAT)).status_code == 200
        policy: Any = proxy.app.runtime.router.policy  # type: ignore[union-attr]
        await until(lambda: policy.recomputes >= 3)
        assert policy.recomputes >= 3
        task = proxy.app.runtime._recompute_task  # type: ignore[union-attr]
    assert task is not None and task.done()
    stopped_at = policy.recomputes
    await asyncio.sleep(0.05)
    assert policy.recomputes == stopped_at


async def test_a_failing_recompute_does_not_end_the_task() -> None:
    policy = CountsRecomputes(EveryParams(every_s=0.001, fail_first=True))
    task = asyncio.create_task(recompute_tables(lambda: policy))
    await until(lambda: policy.recomputes >= 2)
    assert policy.recomputes >= 2 and not task.done()
    task.cancel()


async def test_a_policy_without_tables_is_never_recomputed() -> None:
    policy = CountsRecomputes(EveryParams(every_s=0.0))
    task = asyncio.create_task(recompute_tables(lambda: policy))
    await asyncio.sleep(0.02)
    assert policy.recomputes == 0 and not task.done()
    task.cancel()
