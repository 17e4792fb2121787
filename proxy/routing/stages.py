"""Asynchronous steps between a request's prediction and its pick, owned by the policy.

The predictors every policy shares are synchronous and cheap (≤ 1 ms, `predictors/
base.py`). A policy that needs more gets a stage here, awaited before the pick:

* ELDR in PD mode: a prefill leg on a prefill backend yields the request's expert
  signature (`proxy/routing/eldr_stage.py`).
* qos_drl with a bucket predictor: the MiniLM encoder (tens of ms per prompt on one
  CPU thread) runs in one worker thread, off the event loop, so other streams keep
  flowing while it runs; requests that arrive while a batch runs go together in the
  next one (`MicroBatcher`), so its cost is shared under load and an idle proxy adds
  no waiting. A predictor that fails or takes longer than `predict_timeout_s` leaves
  the prediction empty (`()`): the policy then decides without predictions, and the
  log says so.

A policy declares its stages (`Staged.stages()`, data: proxy/types.py `StageSpec`) and
proxy/routing/stage_builder.py builds them. The stages belong to the router
(`proxy/routing/router.py`); a policy switch retires them with the old router.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from proxy.types import Backend, ClusterView, Prediction, RequestContext

if TYPE_CHECKING:
    from predictors.buckets.predictor import BucketPrediction

log = logging.getLogger("laneway")
T = TypeVar("T")
R = TypeVar("R")
# The model a request for a name (a base model, LoRA adapter or group) names on a
# backend: Registry.model_on.
ModelOn = Callable[[Backend, str], str]


def base_model(backend: Backend, requested: str) -> str:
    """A `ModelOn` for a fleet without adapters or groups: the backend's model."""
    return backend.model


class BatchPredictor(Protocol):
    def predict_batch(self, prompts: Sequence[str]) -> list[BucketPrediction]: ...


class Stage(Protocol):
    async def predict(self, ctx: RequestContext, data: dict[str, Any], pred: Prediction,
                      view: ClusterView) -> Prediction:
        """`pred` with what this stage learned about the request."""
        ...

    async def close(self) -> None: ...


class MicroBatcher(Generic[T, R]):
    """`await batcher(item)` → `run([item, ...])[i]`, computed in one worker thread.

    When the worker is idle an item starts a batch of its own at once; items that
    arrive while a batch runs wait for it and then go together (at most `max_batch`).
    A caller that gives up (cancelled) does not stop the batch it is in."""

    def __init__(self, run: Callable[[list[T]], Sequence[R]], max_batch: int,
                 name: str = "laneway-batch") -> None:
        self._run = run
        self._max_batch = max_batch
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._draining = False
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self.batches = 0
        self.items = 0

    async def __call__(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch = self._pending[:self._max_batch]
                del self._pending[:self._max_batch]
                self.batches += 1
                self.items += len(batch)
                try:
                    results = await loop.run_in_executor(
                        self._executor, self._run, [item for item, _ in batch])
                except Exception as exc:  # every caller of the batch hears of it
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, future), result in zip(batch, results, strict=True):
                    if not future.done():
                        future.set_result(result)
        finally:
            self._draining = False

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class BucketStage:
    """qos_drl's bucket predictions (per expert: score, length), batched off the loop."""

    def __init__(self, predictor: BatchPredictor, max_batch: int, timeout_s: float) -> None:
        def run(prompts: list[str]) -> list[tuple[tuple[float, ...], tuple[float, ...]]]:
            return [(p.score, p.length) for p in predictor.predict_batch(prompts)]

        self.batcher: MicroBatcher[str, tuple[tuple[float, ...], tuple[float, ...]]] = \
            MicroBatcher(run, max_batch, "laneway-buckets")
        self._timeout_s = timeout_s

    async def predict(self, ctx: RequestContext, data: dict[str, Any], pred: Prediction,
                      view: ClusterView) -> Prediction:
        try:
            scores, lengths = await asyncio.wait_for(self.batcher(ctx.prompt_text),
                                                     self._timeout_s)
        except Exception as exc:  # a model failing costs its prediction, not the request
            log.warning("request %s: bucket predictor %s; deciding without predictions",
                        ctx.request_id, "timed out" if isinstance(exc, TimeoutError)
                        else f"failed ({exc})")
            return dataclasses.replace(pred, expert_scores=(), expert_lengths=())
        return dataclasses.replace(pred, expert_scores=scores, expert_lengths=lengths)

    async def close(self) -> None:
        self.batcher.close()
