"""CORS for browser clients (`server.cors_allow_origins`; off when empty).

An allowed `Origin` gets its preflight (`OPTIONS`) answered here with 204, and every
answer to it carries `access-control-allow-origin` (the origin itself, so `Vary:
Origin`) and exposes laneway's own headers. Requests without an allowed origin are
untouched, and with the list empty nothing is checked at all.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.asgi import Scope, Send, with_headers

_METHODS = b"GET, POST, PUT, DELETE, OPTIONS"
_EXPOSE = (b"x-laneway-backend, x-request-id, retry-after, x-ratelimit-limit-requests, "
           b"x-ratelimit-remaining-requests, x-ratelimit-limit-tokens, "
           b"x-ratelimit-remaining-tokens")
_DEFAULT_HEADERS = b"authorization, content-type, x-api-key"
_MAX_AGE = b"600"


class Cors:
    def __init__(self, origins: Sequence[str]) -> None:
        self._any = "*" in origins
        self._origins = frozenset(o.rstrip("/").encode() for o in origins)

    def allowed_origin(self, scope: Scope) -> bytes | None:
        """The request's `Origin` if it may call the API, else None."""
        origin = next((v for k, v in scope["headers"] if k == b"origin"), None)
        if origin is None or not (self._any or origin in self._origins):
            return None
        return bytes(origin)

    async def preflight(self, scope: Scope, origin: bytes, send: Send) -> None:
        asked = next((v for k, v in scope["headers"]
                      if k == b"access-control-request-headers"), _DEFAULT_HEADERS)
        await send({"type": "http.response.start", "status": 204, "headers": [
            (b"access-control-allow-origin", origin), (b"vary", b"Origin"),
            (b"access-control-allow-methods", _METHODS),
            (b"access-control-allow-headers", asked),
            (b"access-control-max-age", _MAX_AGE)]})
        await send({"type": "http.response.body", "body": b""})

    @staticmethod
    def answering(send: Send, origin: bytes) -> Send:
        """`send` that adds the CORS headers to the response's start."""
        return with_headers(send, ((b"access-control-allow-origin", origin),
                                   (b"access-control-expose-headers", _EXPOSE),
                                   (b"vary", b"Origin")))
