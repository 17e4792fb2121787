"""Where the plugin meets vLLM 0.32: the model runner and the MoE routers.

Both patches are on classes, so they apply in whichever process builds a model
runner (vLLM's engine core; the API server never loads the model). After
`load_model` every `MoERunner`'s router gets a capture callback -- the same
`BaseRouter.capture_fn` vLLM's own `--enable-return-routed-experts` capturer uses on
GPU; an already bound callback is chained, not replaced. `execute_model` brackets
each step so the recorder knows which token rows belong to which request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from laneway_eldr.recorder import ExpertRecorder
from laneway_eldr.server import serve

logger = logging.getLogger("laneway_eldr")
_installed = False


def install(host: str, port: int) -> None:
    global _installed
    if _installed:  # vLLM may load plugins more than once per process
        return
    _installed = True
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runners: list[Any] = [GPUModelRunner]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        runners.append(CPUModelRunner)
    except ImportError:  # a GPU-only build
        pass
    for cls in runners:
        if "load_model" in vars(cls):
            cls.load_model = _after_load(cls.load_model, host, port)
    GPUModelRunner.execute_model = _bracket_step(  # type: ignore[method-assign]
        GPUModelRunner.execute_model)


def _after_load(load: Callable[..., Any], host: str, port: int) -> Callable[..., Any]:
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = load(self, *args, **kwargs)
        if getattr(self, "_laneway_eldr", None) is None:
            self._laneway_eldr = _bind(self, host, port)
        return result
    return load_model


def _bind(runner: Any, host: str, port: int) -> ExpertRecorder | None:
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    routers = [(m.layer_id, m.router) for m in runner.get_model().modules()
               if isinstance(m, MoERunner) and isinstance(m.router, BaseRouter)]
    if not routers:
        logger.warning("laneway_eldr: no MoE router found; plugin idle")
        return None
    layer_ids = sorted(layer_id for layer_id, _ in routers)
    experts = runner.model_config.get_num_experts()
    recorder = ExpertRecorder(len(layer_ids), experts, runner.cache_config.block_size)
    for layer_id, router in routers:
        router.set_capture_fn(_capture(recorder, layer_ids.index(layer_id),
                                       router.capture_fn))
    serve(recorder, host, port)
    logger.info("laneway_eldr: %d MoE layers x %d experts, side endpoint %s:%d",
                len(layer_ids), experts, host, port)
    return recorder


def _capture(recorder: ExpertRecorder, layer: int,
             chained: Callable[[Any], None] | None) -> Callable[[Any], None]:
    def capture(topk_ids: Any) -> None:
        if chained is not None:
            chained(topk_ids)
        recorder.capture(layer, topk_ids.detach().to("cpu").numpy().copy())
    return capture


def _bracket_step(execute: Callable[..., Any]) -> Callable[..., Any]:
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        recorder: ExpertRecorder | None = getattr(self, "_laneway_eldr", None)
        if recorder is None:
            return execute(self, scheduler_output, *args, **kwargs)
        computed = {new.req_id: new.num_computed_tokens
                    for new in scheduler_output.scheduled_new_reqs}
        for new in scheduler_output.scheduled_new_reqs:
            recorder.new_request(new.req_id, new.prompt_token_ids or [])
        cached = scheduler_output.scheduled_cached_reqs
        for req_id in cached.resumed_req_ids:
            recorder.restart(req_id)
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        recorder.begin_step()
        result = execute(self, scheduler_output, *args, **kwargs)
        scheduled = scheduler_output.num_scheduled_tokens
        recorder.end_step([(req_id, computed.get(req_id, 0), scheduled[req_id])
                           for req_id in self.input_batch.req_ids if req_id in scheduled])
        recorder.finish(scheduler_output.finished_req_ids)
        return result
    return execute_model
