"""`/admin/...`: operate a running proxy. Served only with `admin.token` set; every
route needs `Authorization: Bearer <token>`, a `Host` this proxy answers to (loopback,
server.host, admin.allowed_hosts: DNS rebinding), no `Origin` of another site, and a
JSON body as `Content-Type: application/json` (a browser's cross-site "simple" request
can send neither). docs/security.md.

GET    /admin/health                   /health with each backend's details

GET    /admin/backends                 backends with live stats, policy, shared state
POST   /admin/backends                 add one: {"name", "url", "model", "labels"?}
DELETE /admin/backends/{name}          stop routing to it, move its tracked streams
                                       (`{"migrate": false}`: let them finish), forget it
POST   /admin/backends/{name}/drain    no new requests go to `name`; its tracked
                                       streams move elsewhere (`{"migrate": false}`:
                                       they finish where they are)
POST   /admin/backends/{name}/undrain  route to `name` again (an ejection by passive
                                       health ends too: back on its next good scrape)
GET    /admin/policy                   {"name", "params"}
PUT    /admin/policy                   switch policy and/or params: {"name", "params"?}
POST   /admin/reload                   re-read the config file (as SIGHUP does)
GET    /admin/lora_adapters            every adapter (served name besides the base
                                       models) and the backends serving it
POST   /admin/lora_adapters            load one on backends: {"lora_name", "lora_path",
                                       "model" | "backends", "load_inplace"?, "timeout_s"?}
DELETE /admin/lora_adapters/{name}     unload it ({"backends"?, "timeout_s"?})
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from pydantic import ValidationError

from policies.base import PolicyLoadError, UnknownPolicyError, build_policy
from proxy.asgi import (
    ClientGone,
    Receive,
    Scope,
    Send,
    header_map,
    read_body,
    send_error,
    send_json,
)
from proxy.config import BackendConfig, ConfigError, PolicyConfig
from proxy.errors import (
    Conflict,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    ProxyError,
)
from proxy.http import lora_admin
from proxy.http.admin_guard import (
    check_backend,
    check_body_type,
    check_kv_events,
    check_request,
    check_save_path,
)
from proxy.reconfigure import add_backend, reload_config, remove_backend, switch_policy
from proxy.runtime import Runtime, backend_of

log = logging.getLogger("laneway.admin")
PREFIX = "/admin/"
_MAX_BODY = 64 * 1024
Action = Callable[[Runtime, list[str], bytes], Awaitable[tuple[int, Any]]]


async def handle_admin(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    try:
        headers = header_map(scope)
        check_request(rt.settings.admin, rt.settings.server.host, headers)
        parts = scope["path"][len(PREFIX):].strip("/").split("/")
        action = _route(parts, scope["method"], scope["path"])
        body = await read_body(headers, receive, _MAX_BODY, rt.settings.server.body_timeout_s)
        check_body_type(headers, body)
        status, payload = await action(rt, parts, body)
        await send_json(send, status, payload)
    except ClientGone:
        return
    except ProxyError as err:
        await send_error(send, err)


def _route(parts: list[str], method: str, path: str) -> Action:
    if parts[0] == "backends" and len(parts) == 1:
        key = ("backends", method)
    elif parts[0] == "backends" and len(parts) == 2:
        key = ("backend", method)
    elif parts[0] == "backends" and len(parts) == 3 and parts[2] in ("drain", "undrain"):
        key = (parts[2], method)
    elif len(parts) == 1 and parts[0] in ("health", "policy", "reload", "lora_adapters"):
        key = (parts[0], method)
    elif parts[0] == "lora_adapters" and len(parts) == 2:
        key = ("lora_adapter", method)
    else:
        raise NotFound(f"No admin route for {path}.")
    action = _ACTIONS.get(key)
    if action is None:
        allowed = ", ".join(m for (name, m) in _ACTIONS if name == key[0])
        raise MethodNotAllowed(f"{path} accepts {allowed}.")
    return action


# -- actions ---------------------------------------------------------------------------
async def _list(rt: Runtime, parts: list[str], body: bytes) -> tuple[int, Any]:
    return 200, {
        "policy": {"name": rt.router.policy_name, "params": rt.settings.policy.params},
        "replica": rt.replica_id,
        "state": {"backend": rt.settings.state.backend,
                  "connected": rt.replicator.connected,
                  "replicas": rt.replicator.replicas},
        "backends": [_describe(rt, b.name) for b in rt.registry.all()],
    }


def _describe(rt: Runtime, name: str) -> dict[str, Any]:
    backend = rt.registry.get(name)
    assert backend is not None
    stats = rt.registry.stats.get(name)
    return {
        "name": name, "url": backend.url, "model": backend.model,
        "serves": sorted(rt.registry.served_by(name)),  # with its LoRA adapters
        "labels": dict(backend.labels),
        "healthy": rt.registry.is_healthy(name),
        "draining": rt.registry.is_draining(name),
        "ejected_for_s": round(rt.outliers.ejected_for(name), 1),  # passive health
        "inflight": rt.registry.local_inflight.get(name, 0),  # via this replica
        "cluster_inflight": rt.registry.inflight.get(name, 0),  # via every replica
        "tracked_streams": rt.streams.count(name),
        "running": stats.running if stats else None,
        "waiting": stats.waiting if stats else None,
        "kv_usage": stats.kv_usage if stats else None,
        "ttft_s": stats.ttft_s if stats else None,
        "tpot_s": stats.tpot_s if stats else None,
        "prefix_hit_rate": stats.prefix_hit_rate if stats else None,
    }


async def _add(rt: Runtime, parts: list[str], body: bytes) -> tuple[int, Any]:
    data = _json(body)
    try:
        cfg = BackendConfig.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest(_first_error(exc)) from None
    check_backend(rt.settings.admin, str(cfg.url), cfg.url.host or "")
    check_kv_events(rt.settings.admin, cfg.kv_events)
    backend = backend_of(cfg)  # its own api_key, never upstream.api_key
    try:
        add_backend(rt, backend, cfg.kv_events)
    except ValueError:
        raise Conflict(f"A backend named `{cfg.name}` exists already.") from None
    await rt.poller.poll_once()  # know its health before answering
    return 201, _describe(rt, cfg.name)


async def _remove(rt: Runtime, parts: list[str], body: bytes) -> tuple[int, Any]:
    name = _existing(rt, parts[1])
    moving = remove_backend(rt, name, _wants_migration(body))
    return 200, {"backend": name, "removed": True, "moving": moving}


async def _drain(rt: Runtime, parts: list[str], body: bytes) -> tuple[int, Any]:
    name = _existing(rt, parts[1])
    migrate = _wants_migration(body)
    rt.registry.drain(name)
    moved = rt.streams.move_all(name, "drain") if migrate else 0
    log.info("backend %s drained; %d tracked streams asked to move", name, moved)
    return 200, {"backend": name, "draining": True, "moving": moved,
                 "inflight": rt.registry.local_inflight.get(name, 0)}


async def _undrain(rt: Runtime, parts: list[str], body: bytes) -> tuple[int, Any]:
    name = _existing(rt, parts[1])
    rt.registry.undrain(name)
    ejected = rt.outliers.ejected_for(name) > 0
    if ejected:  # an operator who mended it need not wait out its ejection
        rt.outliers.forget(name)
        rt.poller.readmit(name)
    log.info("backend %s undrained%s", name, "; its ejection ended" if ejected else "")
    return 200, {"backend": name, "draining": False, "ejection_ended": ejected}


async def _get_policy(rt: Runtime, parts: list[str], body: bytes) -> tuple[int, Any]:
    return 200, {"name": rt.router.policy_name, "params": rt.settings.policy.params}


async def _put_policy(rt: Runtime, parts: list[str], body: bytes) -> tuple[int, Any]:
    try:
        cfg = PolicyConfig.model_validate(_json(body))
        check_save_path(rt.settings.admin, cfg.params.get("online_save"))
        params = dict(cfg.params)  # built off the loop: a policy may load models
        policy = await asyncio.to_thread(build_policy, cfg.name, params)
        switch_policy(rt, cfg.name, params, policy)
    except UnknownPolicyError as exc:
        raise InvalidRequest(str(exc), param="name") from None
    except ValidationError as exc:
        raise InvalidRequest(_first_error(exc), param="params") from None
    except PolicyLoadError as exc:
        raise InvalidRequest(str(exc), param="params") from None
    return 200, {"name": cfg.name, "params": cfg.params}


async def _health(rt: Runtime, parts: list[str], body: bytes) -> tuple[int, Any]:
    return health_details(rt)


def health_details(rt: Runtime) -> tuple[int, dict[str, Any]]:
    """The fleet's health with each backend's address and load (the admin's view;
    `/health` answers with the status only)."""
    backends: dict[str, Any] = {}
    for backend in rt.registry.all():
        stats = rt.registry.stats.get(backend.name)
        backends[backend.name] = {
            "url": backend.url,
            "model": backend.model,
            "healthy": bool(stats and stats.healthy),
            "inflight": rt.registry.local_inflight.get(backend.name, 0),  # via this replica
            "cluster_inflight": rt.registry.inflight.get(backend.name, 0),  # via all
            "running": stats.running if stats else None,
            "waiting": stats.waiting if stats else None,
            "kv_usage": stats.kv_usage if stats else None,
        }
    up = sum(1 for b in backends.values() if b["healthy"])
    status = "ok" if up == len(backends) and up else ("degraded" if up else "unavailable")
    return 200 if up else 503, {"status": status, "policy": rt.router.policy_name,
                                "healthy_backends": up, "backends": backends}


async def _reload(rt: Runtime, parts: list[str], body: bytes) -> tuple[int, Any]:
    if rt.config_path is None:
        raise InvalidRequest("The proxy was started without a config file.")
    try:
        return 200, await reload_config(rt, rt.config_path)
    except ConfigError as exc:
        raise InvalidRequest(str(exc)) from None


async def _list_adapters(rt: Runtime, parts: list[str], body: bytes) -> tuple[int, Any]:
    bases = {b.model for b in rt.registry.all()}
    adapters: dict[str, list[str]] = {}
    for backend in rt.registry.all():
        for name in sorted(rt.registry.served_by(backend.name) - bases):
            adapters.setdefault(name, []).append(backend.name)
    return 200, {"data": [{"lora_name": name, "backends": names}
                          for name, names in sorted(adapters.items())]}


async def _load_adapter(rt: Runtime, parts: list[str], body: bytes) -> tuple[int, Any]:
    try:
        req = lora_admin.LoadAdapter.model_validate(_json(body))
    except ValidationError as exc:
        raise InvalidRequest(_first_error(exc)) from None
    return await lora_admin.load(rt, req)


async def _unload_adapter(rt: Runtime, parts: list[str], body: bytes) -> tuple[int, Any]:
    try:
        req = lora_admin.UnloadAdapter.model_validate(_json(body))
    except ValidationError as exc:
        raise InvalidRequest(_first_error(exc)) from None
    return await lora_admin.unload(rt, parts[1], req)


_ACTIONS: dict[tuple[str, str], Action] = {
    ("health", "GET"): _health,
    ("backends", "GET"): _list, ("backends", "POST"): _add,
    ("backend", "DELETE"): _remove,
    ("drain", "POST"): _drain, ("undrain", "POST"): _undrain,
    ("policy", "GET"): _get_policy, ("policy", "PUT"): _put_policy,
    ("reload", "POST"): _reload,
    ("lora_adapters", "GET"): _list_adapters, ("lora_adapters", "POST"): _load_adapter,
    ("lora_adapter", "DELETE"): _unload_adapter,
}


# -- helpers ---------------------------------------------------------------------------
def _existing(rt: Runtime, name: str) -> str:
    if rt.registry.get(name) is None:
        raise NotFound(f"No backend named `{name}`.")
    return name


def _json(body: bytes) -> Any:
    try:
        return orjson.loads(body) if body.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc}") from None


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    return f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"


def _wants_migration(body: bytes) -> bool:
    data = _json(body)
    migrate = data.get("migrate", True) if isinstance(data, dict) else None
    if not isinstance(migrate, bool):
        raise InvalidRequest("`migrate` must be a boolean.", param="migrate")
    return migrate
