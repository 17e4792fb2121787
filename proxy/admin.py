"""`/admin/...`: operate a running proxy (drain a backend and move its streams).

POST /admin/backends/{name}/drain    no new requests go to `name`; its tracked
                                     streams move elsewhere (`{"migrate": false}`:
                                     they finish where they are)
POST /admin/backends/{name}/undrain  route to `name` again
"""

from __future__ import annotations

import hmac
import logging

import orjson

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
from proxy.errors import InvalidRequest, MethodNotAllowed, NotFound, ProxyError, Unauthorized
from proxy.runtime import Runtime

log = logging.getLogger("laneway.admin")
PREFIX = "/admin/"
_MAX_BODY = 64 * 1024


async def handle_admin(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    try:
        headers = header_map(scope)
        _authorize(rt, headers)
        parts = scope["path"][len(PREFIX):].strip("/").split("/")
        if len(parts) != 3 or parts[0] != "backends" or parts[2] not in ("drain", "undrain"):
            raise NotFound(f"No admin route for {scope['path']}.")
        if scope["method"] != "POST":
            raise MethodNotAllowed(f"{scope['path']} accepts POST only.")
        body = await read_body(headers, receive, _MAX_BODY)
        name, action = parts[1], parts[2]
        if rt.registry.get(name) is None:
            raise NotFound(f"No backend named `{name}`.")
        if action == "undrain":
            rt.registry.undrain(name)
            log.info("backend %s undrained", name)
            await send_json(send, 200, {"backend": name, "draining": False})
            return
        moved = _drain(rt, name, _wants_migration(body))
        await send_json(send, 200, {"backend": name, "draining": True, "moving": moved,
                                    "inflight": rt.registry.inflight.get(name, 0)})
    except ClientGone:
        return
    except ProxyError as err:
        await send_error(send, err)


def _authorize(rt: Runtime, headers: dict[str, str]) -> None:
    token = rt.settings.admin.token
    if token is None:
        return
    given = headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise Unauthorized("The admin API needs `Authorization: Bearer <admin.token>`.")


def _wants_migration(body: bytes) -> bool:
    if not body.strip():
        return True
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc}") from None
    migrate = data.get("migrate", True) if isinstance(data, dict) else None
    if not isinstance(migrate, bool):
        raise InvalidRequest("`migrate` must be a boolean.", param="migrate")
    return migrate


def _drain(rt: Runtime, name: str, migrate: bool) -> int:
    rt.registry.drain(name)
    moved = rt.streams.move_all(name, "drain") if migrate else 0
    log.info("backend %s drained; %d tracked streams asked to move", name, moved)
    return moved
