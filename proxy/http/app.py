"""The ASGI application: a table of routes and a lifespan.

Plain ASGI rather than FastAPI on purpose: FastAPI's routing and request objects
cost ~0.5 ms p50 per request here, half of the proxy's whole latency budget. A table of
exact paths (the generation routes, three small GET routes, the pass-through POST routes
of proxy/http/passthrough_routes.py) and two prefixes (/admin/, /v1/responses/{id}) do not need a
framework.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from policies.base import Policy
from proxy.asgi import Receive, Scope, Send, header_map, send_bytes, send_error, send_json
from proxy.config import Settings
from proxy.errors import InternalError, MethodNotAllowed, NotFound, ProxyError
from proxy.http.admin import PREFIX as ADMIN_PREFIX
from proxy.http.admin import handle_admin, health_details
from proxy.http.cors import Cors
from proxy.http.generation_routes import handle_completion
from proxy.http.passthrough_routes import PATHS as PASSTHROUGH_PATHS
from proxy.http.passthrough_routes import handle_passthrough
from proxy.http.stored_responses import PREFIX as RESPONSES_PREFIX
from proxy.http.stored_responses import handle_stored
from proxy.observability.access_log import Http, logged
from proxy.reconfigure import install_sighup, remove_sighup
from proxy.runtime import Runtime

log = logging.getLogger("laneway")
Handler = Callable[[Runtime, Scope, Receive, Send], Awaitable[None]]


async def _chat(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    await handle_completion(rt, "chat", scope, receive, send)


async def _completions(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    await handle_completion(rt, "completions", scope, receive, send)


async def _responses(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    await handle_completion(rt, "responses", scope, receive, send)


async def _messages(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    await handle_completion(rt, "messages", scope, receive, send)


async def _models(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    created = int(rt.started_at_wall)
    try:  # with auth on: 401 without a valid key, and only the key's models
        models = rt.auth.visible_models(header_map(scope), rt.registry.healthy_models())
    except ProxyError as err:
        await send_error(send, err)
        return
    data: list[dict[str, Any]] = []
    for model in models:
        entry = {"id": model, "object": "model", "created": created, "owned_by": "laneway"}
        context = rt.registry.model_context(model)
        if context is not None:  # as vLLM lists it: clients size their prompts by it
            entry["max_model_len"] = context
        data.append(entry)
    await send_json(send, 200, {"object": "list", "data": data})


async def _livez(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    """The process serves (a liveness probe): 200 whatever the backends' health, which
    `/health` reports (a readiness probe)."""
    await send_json(send, 200, {"status": "ok"})


async def _health(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    """Readiness, for anyone who can reach the port: the status only. Which backends,
    where, and how loaded is the admin's to read (`GET /admin/health`)."""
    status, details = health_details(rt)
    await send_json(send, status, {"status": details["status"]})


async def _metrics(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    body = rt.metrics.render()
    await send_bytes(send, 200, body, [
        (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
    ])


ROUTES: dict[str, tuple[str, Handler]] = {
    "/v1/chat/completions": ("POST", _chat),
    "/v1/completions": ("POST", _completions),
    "/v1/responses": ("POST", _responses),
    "/v1/messages": ("POST", _messages),
    "/v1/models": ("GET", _models),
    "/health": ("GET", _health),
    "/livez": ("GET", _livez),
    "/metrics": ("GET", _metrics),
    **{path: ("POST", handle_passthrough) for path in PASSTHROUGH_PATHS},
}


class LanewayApp:
    """ASGI entry point. The runtime exists between lifespan startup and shutdown."""

    def __init__(self, settings: Settings, config_path: str | None = None,
                 policy: Policy | None = None) -> None:
        self.settings = settings
        self.config_path = config_path
        self.policy = policy  # built from settings.policy by the config check, if it ran
        origins = settings.server.cors_allow_origins
        self.cors = Cors(origins) if origins else None
        self.runtime: Runtime | None = None

    def refused_by_server(self, err: ProxyError) -> None:
        """A connection got `err` from the server itself (proxy/http/protocol.py: a 408,
        431 or malformed request's 400): counted with the proxy's other error answers."""
        if self.runtime is not None:
            self.runtime.count_refused(err)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                http: Http = self._http
                tracing = self.runtime.tracing if self.runtime is not None else None
                if tracing is not None and scope["path"].startswith("/v1/"):
                    http = functools.partial(tracing.traced, http)
                if self.settings.server.access_log:
                    await logged(http, scope, receive, send)
                else:
                    await http(scope, receive, send)
            except Exception:
                await self._internal_error(scope, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _internal_error(self, scope: Scope, send: Send) -> None:
        """The last resort for a bug: logged with its traceback, and answered with an
        OpenAI-shaped 500 instead of uvicorn's plain text. A response already under way
        is cut off instead (a stream without its end), which its client sees."""
        log.exception("internal error answering %s %s", scope["method"], scope["path"])
        err = InternalError("laneway failed on this request (an internal error, logged).")
        if self.runtime is not None:
            self.runtime.count_refused(err)
        with contextlib.suppress(Exception):  # the response had started
            await send_error(send, err, anthropic=scope["path"].startswith("/v1/messages"))

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.cors is not None and (origin := self.cors.allowed_origin(scope)) is not None:
            if scope["method"] == "OPTIONS":
                await self.cors.preflight(scope, origin, send)
                return
            send = self.cors.answering(send, origin)
        route = ROUTES.get(scope["path"])
        if route is None and scope["path"].startswith(ADMIN_PREFIX):
            assert self.runtime is not None, "lifespan did not run"
            if self.runtime.settings.admin.on:  # as last (re)loaded
                await handle_admin(self.runtime, scope, receive, send)
                return
        if route is None and scope["path"].startswith(RESPONSES_PREFIX):
            assert self.runtime is not None, "lifespan did not run"
            await handle_stored(self.runtime, scope, receive, send)
            return
        if route is None:
            await send_error(send, NotFound(f"No route for {scope['path']}."))
            return
        method, handler = route
        if scope["method"] != method:
            await send_error(send, MethodNotAllowed(f"{scope['path']} accepts {method} only."))
            return
        assert self.runtime is not None, "lifespan did not run"
        await handler(self.runtime, scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    self.runtime = Runtime(self.settings, self.config_path, self.policy)
                    await self.runtime.start()
                    if self.config_path is not None:
                        install_sighup(self.runtime, self.config_path)
                except Exception as exc:
                    log.exception("startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.runtime is not None:
                    if self.config_path is not None:
                        remove_sighup()
                    await self.runtime.close()
                await send({"type": "lifespan.shutdown.complete"})
                return
