"""proxy/routing/stages.py: the micro-batcher and qos_drl's bucket stage (off the event loop,
batched across concurrent arrivals, never failing a request), and stages retired with
their router on a policy switch."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from policies.base import build_policy
from proxy.routing.router import Router
from proxy.routing.stages import BucketStage, MicroBatcher
from proxy.types import NO_PREDICTION, ClusterView
from tests.policies.helpers import ctx

VIEW = ClusterView((), {}, {}, 0.0)


class SlowModel:
    """Records its batches; each takes `seconds` of wall time in the worker thread."""

    def __init__(self, seconds: float = 0.05, fail: bool = False) -> None:
        self.seconds = seconds
        self.fail = fail
        self.batches: list[list[str]] = []
        self.threads: set[str] = set()

    def __call__(self, prompts: list[str]) -> list[str]:
        self.threads.add(threading.current_thread().name)
        self.batches.append(list(prompts))
        time.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("model broke")
        return [p.upper() for p in prompts]

    def predict_batch(self, prompts: Sequence[str]) -> list[Any]:
        return [SimpleNamespace(score=(len(p) / 10,), length=(float(len(p)),))
                for p in self(list(prompts))]


async def test_arrivals_during_a_batch_go_together_in_the_next() -> None:
    model = SlowModel()
    batcher: MicroBatcher[str, str] = MicroBatcher(model, max_batch=3)
    first = asyncio.create_task(batcher("a"))
    await asyncio.sleep(0.01)  # "a" runs alone at once; these wait for it
    later = [asyncio.create_task(batcher(x)) for x in "bcde"]
    assert await first == "A"
    assert [await t for t in later] == ["B", "C", "D", "E"]
    batcher.close()
    assert model.batches == [["a"], ["b", "c", "d"], ["e"]]
    assert (batcher.batches, batcher.items) == (3, 5)
    assert model.threads == {"laneway-batch_0"}  # one worker thread, not the loop's


async def test_the_event_loop_keeps_running_while_the_model_does() -> None:
    batcher: MicroBatcher[str, str] = MicroBatcher(SlowModel(seconds=0.3), max_batch=4)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    assert await batcher("x") == "X"
    task.cancel()
    batcher.close()
    assert ticks >= 10  # a model run on the loop itself would allow none


async def test_a_failing_batch_fails_its_callers_and_the_next_batch_runs() -> None:
    model = SlowModel(fail=True)
    batcher: MicroBatcher[str, str] = MicroBatcher(model, max_batch=4)
    results = await asyncio.gather(batcher("a"), batcher("b"), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    model.fail = False
    assert await batcher("c") == "C"
    batcher.close()


async def test_a_caller_that_gives_up_does_not_stop_the_others() -> None:
    batcher: MicroBatcher[str, str] = MicroBatcher(SlowModel(), max_batch=4)
    gone = asyncio.create_task(batcher("a"))
    kept = asyncio.create_task(batcher("b"))
    await asyncio.sleep(0.01)
    gone.cancel()
    assert await kept == "B"
    batcher.close()


async def test_the_bucket_stage_fills_the_prediction() -> None:
    stage = BucketStage(SlowModel(seconds=0.0), max_batch=8, timeout_s=5)
    pred = await stage.predict(ctx("four"), {}, NO_PREDICTION, VIEW)
    await stage.close()
    assert pred.expert_scores == (0.4,) and pred.expert_lengths == (4.0,)


# (a predictor that fails at once gets time to: on a loaded machine 0.1 s may pass first)
@pytest.mark.parametrize(("model", "timeout_s", "said"), [
    (SlowModel(seconds=1.0), 0.1, "timed out"),
    (SlowModel(seconds=0.0, fail=True), 10.0, "failed")])
async def test_a_slow_or_broken_predictor_leaves_the_prediction_empty(
        model: SlowModel, timeout_s: float, said: str, caplog: pytest.LogCaptureFixture) -> None:
    stage = BucketStage(model, max_batch=8, timeout_s=timeout_s)
    with caplog.at_level(logging.WARNING, logger="laneway"):
        pred = await stage.predict(ctx("p", request_id="req-9"), {}, NO_PREDICTION, VIEW)
    await stage.close()
    assert pred.expert_scores == () and pred.expert_lengths == ()
    assert f"request req-9: bucket predictor {said}" in caplog.text


class _Stage:
    def __init__(self) -> None:
        self.closed = False

    async def predict(self, ctx: Any, data: Any, pred: Any, view: Any) -> Any:
        return pred

    async def close(self) -> None:
        self.closed = True


async def test_a_replaced_router_closes_its_stages_after_the_grace() -> None:
    from proxy.config import Settings
    from proxy.runtime import Runtime

    rt = Runtime(Settings.model_validate(
        {"backends": [{"name": "a", "url": "http://127.0.0.1:9", "model": "m"}]}))
    stage = _Stage()
    old = rt.router
    old.stages = [stage]
    new = Router(build_policy("round_robin", {}), rt.metrics, log_decisions=False)
    rt.replace_router(new, grace_s=0.05)
    assert rt.router is new and not stage.closed  # requests it prepared may still run
    await asyncio.sleep(0.2)
    assert stage.closed
    await rt.close()
