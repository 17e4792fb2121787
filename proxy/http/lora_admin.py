"""`/admin/lora_adapters`: load or unload a LoRA adapter on a set of backends at once.

vLLM loads an adapter at run time with `POST /v1/load_lora_adapter` (and unloads it with
`/v1/unload_lora_adapter`) when started with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` and
`--enable-lora`. These routes make that call on every backend named (or every backend
whose base model is `model`), concurrently, each under `timeout_s`, and read the
backends' `/v1/models` right after, so the adapter is routable (or not) from the next
request on instead of from the next periodic read. The answer reports each backend:
`loaded` / `already_loaded`, `unloaded` / `not_loaded`, or `failed` with vLLM's reason.
Every backend done: 200; any failed: 502 `lora_failed` with the same report, as a retry
is safe (a backend that has the adapter answers `already_loaded`).

Unloading stops routing to the adapter on those backends first, then unloads it, so no
new request is sent to an adapter that is going away. With shared state (`state.backend:
redis`) the other replicas read those backends' lists within a sync interval
(proxy/fleet/discovery.py); without it, at their next read (`poller.models_interval_s`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from proxy.errors import InvalidRequest, NotFound
from proxy.relay.upstream import UpstreamFailure
from proxy.runtime import Runtime
from proxy.types import Backend

log = logging.getLogger("laneway.admin")
_CONCURRENT = 32  # backends called at once
_JSON = {"content-type": "application/json"}

Outcome = Literal["loaded", "already_loaded", "unloaded", "not_loaded", "failed"]


class LoadAdapter(BaseModel):
    """Body of `POST /admin/lora_adapters`."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)  # on the backends' machines
    model: str | None = None  # every backend whose base model this is ...
    backends: list[str] | None = Field(default=None, min_length=1)  # ... or these
    load_inplace: bool = False  # replace an adapter of that name (vLLM's flag)
    timeout_s: float = Field(default=120.0, gt=0, le=3600)

    @model_validator(mode="after")
    def _one_target(self) -> LoadAdapter:
        if (self.model is None) == (self.backends is None):
            raise ValueError("name either `model` (every backend of that base model) "
                             "or `backends` (a list of backend names)")
        return self


class UnloadAdapter(BaseModel):
    """Body of `DELETE /admin/lora_adapters/{name}` (optional)."""

    model_config = ConfigDict(extra="forbid")
    backends: list[str] | None = Field(default=None, min_length=1)  # default: all with it
    timeout_s: float = Field(default=120.0, gt=0, le=3600)


async def load(rt: Runtime, req: LoadAdapter) -> tuple[int, dict[str, Any]]:
    if req.lora_name in {b.model for b in rt.registry.all()}:
        raise InvalidRequest(f"`{req.lora_name}` is a backend's base model, not an "
                             "adapter name.", param="lora_name")
    targets = _targets(rt, req.backends, req.model)
    body = orjson.dumps({"lora_name": req.lora_name, "lora_path": req.lora_path,
                         "load_inplace": req.load_inplace})
    results = await _each(rt, targets, "/v1/load_lora_adapter", body, req.timeout_s,
                          done="loaded", idle="already_loaded",
                          idle_if=(400, "already been loaded"))
    await _refresh(rt, targets)
    return _report(req.lora_name, "load", results)


async def unload(rt: Runtime, name: str, req: UnloadAdapter) -> tuple[int, dict[str, Any]]:
    if req.backends is not None:
        targets = _targets(rt, req.backends, None)
    else:
        targets = [b for b in rt.registry.all()
                   if name in rt.registry.served_by(b.name) and name != b.model]
        if not targets:
            raise NotFound(f"No backend serves an adapter named `{name}`.")
    for backend in targets:  # no new request goes to it while it is unloaded
        served = rt.registry.served_by(backend.name)
        if name in served and name != backend.model:
            rt.registry.set_served(backend.name, served - {name}, backend.model in served)
    body = orjson.dumps({"lora_name": name})
    results = await _each(rt, targets, "/v1/unload_lora_adapter", body, req.timeout_s,
                          done="unloaded", idle="not_loaded",
                          idle_if=(404, "cannot be found"))
    await _refresh(rt, targets)  # a backend that failed to unload it serves it again
    return _report(name, "unload", results)


def _targets(rt: Runtime, names: list[str] | None, model: str | None) -> list[Backend]:
    if names is not None:
        unknown = [n for n in names if rt.registry.get(n) is None]
        if unknown:
            raise NotFound(f"No backend named {', '.join(f'`{n}`' for n in unknown)}.")
        wanted = set(names)
        return [b for b in rt.registry.all() if b.name in wanted]
    targets = [b for b in rt.registry.all() if b.model == model]
    if not targets:
        raise NotFound(f"No backend has the base model `{model}`.", param="model")
    return targets


async def _each(rt: Runtime, targets: list[Backend], path: str, body: bytes,
                timeout_s: float, *, done: Outcome, idle: Outcome,
                idle_if: tuple[int, str]) -> list[dict[str, Any]]:
    """Call `path` on every target; each one's outcome: `done` on a 200, `idle` on vLLM's
    answer (status, words in its message) `idle_if`, else `failed`."""
    slots = asyncio.Semaphore(_CONCURRENT)

    async def call(backend: Backend) -> dict[str, Any]:
        async with slots:
            try:
                status, answer, _ = await rt.upstream.whole(
                    "POST", backend, path, body, dict(_JSON), timeout_s=timeout_s)
            except UpstreamFailure as failure:
                return {"backend": backend.name, "result": "failed", "status": None,
                        "detail": f"{failure.kind}: {failure.detail}"}
        detail = _message(answer)
        if status == 200:
            result: Outcome = done
        elif status == idle_if[0] and idle_if[1] in detail:  # nothing to do there
            result = idle
        else:
            result = "failed"
            if status == 404 and "lora" not in detail.lower():  # no such route
                detail = (f"{path} is not served: start vLLM with --enable-lora and "
                          "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
        log.log(logging.WARNING if result == "failed" else logging.INFO,
                "backend %s: %s → %s (HTTP %d: %s)", backend.name, path, result, status,
                detail)
        return {"backend": backend.name, "result": result, "status": status,
                "detail": detail}

    return list(await asyncio.gather(*(call(b) for b in targets)))


async def _refresh(rt: Runtime, targets: list[Backend]) -> None:
    """Read the targets' lists here now, and have the other replicas read them."""
    await rt.discovery.once([b for b in targets if rt.registry.get(b.name) is not None])
    rt.discovery.announce(b.name for b in targets)


def _report(name: str, action: str, results: list[dict[str, Any]]
            ) -> tuple[int, dict[str, Any]]:
    failed = [r["backend"] for r in results if r["result"] == "failed"]
    report: dict[str, Any] = {"lora_name": name, "backends": results}
    if not failed:
        return 200, report
    report["error"] = {
        "message": f"Could not {action} `{name}` on {', '.join(failed)} "
                   f"({len(failed)} of {len(results)} backends); see `backends`. "
                   "Retrying is safe.",
        "type": "upstream_error", "param": None, "code": "lora_failed"}
    return 502, report


def _message(answer: bytes) -> str:
    """vLLM's message: its plain-text success, or its error JSON's message."""
    text = answer[:2000].decode(errors="replace")
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return text
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])[:2000]
    return text
