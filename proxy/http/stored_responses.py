"""The Responses API's stored responses: which backend holds each one.

A vLLM server started with `VLLM_ENABLE_RESPONSES_API_STORE=1` keeps every response it
made (`store`, on by default in the API); `previous_response_id`,
`GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel` work only on that
server. The proxy remembers the backend of each response id it relayed (bounded, least
recently used out first). For an id it does not know (relayed by another replica, or
before a restart) it asks the candidate backends at once (`GET /v1/responses/{id}`,
`responses.lookup_timeout_s`) and uses the one that has it. With shared state
(`state.backend: redis`) the replicas tell each other the homes they learn (table
`responses`, proxy/state/replicator.py), so a conversation whose turns a load balancer
spreads over the replicas finds its home without asking, a sync interval after the turn
that made it; the lookup stays as the fallback (a restart, a Redis outage).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, quote

import orjson

from proxy.asgi import Receive, Scope, Send, header_map, until_disconnect
from proxy.errors import (
    MethodNotAllowed,
    NotFound,
    PermissionDenied,
    ProxyError,
)
from proxy.relay.stream_accounting import RESPONSES_END, StreamTally
from proxy.relay.upstream import UpstreamFailure, exhausted, forward_headers, relay_answer
from proxy.request_context import request_id
from proxy.types import Backend

if TYPE_CHECKING:
    from proxy.admission.auth import ApiKey
    from proxy.runtime import Runtime

PREFIX = "/v1/responses/"
_ID = re.compile(rb'"id"\s*:\s*"(resp_[^"\\]{1,200})"')


def response_id_in(data: bytes) -> str | None:
    """The first response id (`resp_…`) in a response body or stream chunk."""
    found = _ID.search(data)
    return found.group(1).decode() if found else None


async def home_of(rt: Runtime, response_id: str, candidates: Sequence[Backend],
                  headers: dict[str, str]) -> Backend | None:
    """The candidate that holds `response_id`: the remembered one, else the first to
    answer `GET /v1/responses/{id}` with 200 (and it is remembered)."""
    known = rt.responses.get(response_id)
    if known is not None:
        rt.metrics.response_homes.labels("remembered").inc()
        return next((b for b in candidates if b.name == known), None)

    async def holds(backend: Backend) -> Backend:
        status, _, _ = await rt.upstream.whole(
            "GET", backend, PREFIX + quote(response_id, safe=""), None, headers,
            timeout_s=rt.settings.responses.lookup_timeout_s)
        if status != 200:
            raise LookupError(backend.name)
        return backend

    asks = [asyncio.create_task(holds(b)) for b in candidates]
    try:
        for done in asyncio.as_completed(asks):
            with contextlib.suppress(LookupError, UpstreamFailure):
                home = await done
                rt.responses.learn(response_id, home.name)
                rt.metrics.response_homes.labels("asked").inc()
                return home
        rt.metrics.response_homes.labels("missing").inc()
        return None
    finally:
        for task in asks:
            task.cancel()


async def handle_stored(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    """`GET /v1/responses/{id}` (whole, or streamed with `?stream=true`) and
    `POST /v1/responses/{id}/cancel`, on the backend that holds the response."""
    rest = scope["path"][len(PREFIX):]
    response_id, _, action = rest.partition("/")
    method = "POST" if action == "cancel" else "GET"
    headers = header_map(scope)
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    streamed = method == "GET" and query.get("stream", [""])[-1].lower() == "true"
    try:
        if action not in ("", "cancel") or response_id in ("", ".", ".."):
            raise NotFound(f"No route for {scope['path']}.")  # ("..": a path, not an id)
        if scope["method"] != method:
            raise MethodNotAllowed(f"{scope['path']} accepts {method} only.")
        # 401 without a valid key (when auth is on), 429 over its requests per minute:
        # before any backend is asked, as for a generation
        key = rt.auth.admit_read(headers)
        upstream_headers = forward_headers(scope["headers"], not rt.auth.cfg.enabled)
        up = [b for b in rt.registry.all() if rt.registry.is_healthy(b.name)
              and (key is None or _serves_allowed(rt, key, b))]
        home = await home_of(rt, response_id, up, upstream_headers)
        if home is None:
            raise NotFound(f"Response with id '{response_id}' not found on any healthy "
                           "backend.")
        if key is not None and key.models:
            model = await _model_of(rt, home, response_id, upstream_headers)
            if not any(map(key.allows, rt.registry.names_for(model))):
                raise PermissionDenied(f"The key `{key.name}` may not use model "
                                       f"`{model}`.", param="model")
        try:
            opened = await rt.upstream.open(
                home, _upstream_path(response_id, action, scope),
                b"" if method == "POST" else None,
                upstream_headers, stream=streamed, method=method)
        except UpstreamFailure as failure:
            rt.upstream_failed(failure, home.model)
            raise exhausted(home.model, [failure], rt.settings.server.retry_after_s) \
                from None
    except ProxyError as err:
        await rt.refuse(send, err)
        return
    tally = StreamTally(time.monotonic(), RESPONSES_END)
    await until_disconnect(receive, relay_answer(
        opened, send, request_id(headers), tally, rt.settings.upstream.read_timeout_s,
        rt.count_upstream_error), lambda: None)


def _serves_allowed(rt: Runtime, key: ApiKey, backend: Backend) -> bool:
    """Whether `backend` serves a model (or adapter) `key` may use: only those are asked
    for an id, so a key cannot probe the others."""
    return any(key.allows(name) for model in rt.registry.served_by(backend.name)
               for name in rt.registry.names_for(model))


async def _model_of(rt: Runtime, home: Backend, response_id: str,
                    headers: dict[str, str]) -> str:
    """The model that made the stored response (its `model`: an adapter's name, not the
    backend's base model); "" when the backend does not say."""
    try:
        status, body, _ = await rt.upstream.whole(
            "GET", home, PREFIX + quote(response_id, safe=""), None, headers,
            timeout_s=rt.settings.responses.lookup_timeout_s)
        model = orjson.loads(body).get("model") if status == 200 else None
    except (UpstreamFailure, orjson.JSONDecodeError, AttributeError):
        model = None
    return model if isinstance(model, str) else ""


def _upstream_path(response_id: str, action: str, scope: Scope) -> str:
    """The route on the backend, with the request's query (`?include=…`): the id
    escaped again, as the lookup sends it (`%3F` in an id stays part of the id)."""
    query: bytes = scope.get("query_string", b"")
    path = PREFIX + quote(response_id, safe="") + ("/" + action if action else "")
    return path + ("?" + query.decode("latin-1") if query else "")
