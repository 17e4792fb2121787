"""Every error the proxy reports, and the one place that turns them into wire bytes.

Handlers raise `ProxyError` subclasses; `error_response` and `stream_error_event`
render them in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import orjson


class ProxyError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def headers(self) -> list[tuple[bytes, bytes]]:
        return []


class InternalError(ProxyError):
    """A bug in the proxy: neither the client's fault nor a backend's."""

    code = "internal_error"


class InvalidRequest(ProxyError):
    status = 400
    type = "invalid_request_error"


class NotFound(ProxyError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model")


class Unauthorized(ProxyError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(ProxyError):
    """A valid key asked for something it may not use (a model outside its list)."""

    status = 403
    type = "invalid_request_error"
    code = "model_not_allowed"


class Forbidden(ProxyError):
    """A request the admin API refuses whoever sends it: from a browser page of another
    origin, for a host name it does not serve (DNS rebinding), or a backend or path
    outside what the config allows."""

    status = 403
    type = "invalid_request_error"
    code = "forbidden"


class UnsupportedMediaType(ProxyError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class RateLimited(ProxyError):
    """A key went over its requests or tokens per minute (OpenAI: type = the limit)."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, limit: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.type = limit  # "requests" or "tokens", as OpenAI reports it
        self.retry_after_s = retry_after_s

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(self.retry_after_s).encode())]


class Conflict(ProxyError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class MethodNotAllowed(ProxyError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(ProxyError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class HeadersTooLarge(ProxyError):
    """The request line and headers passed `server.max_header_bytes` or
    `server.max_header_count`; the connection is closed."""

    status = 431
    type = "invalid_request_error"
    code = "request_header_fields_too_large"

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"connection", b"close")]


class RequestTimeout(ProxyError):
    """The client did not send its request's headers or body in time; the connection
    is closed."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"connection", b"close")]


class NoHealthyBackend(ProxyError):
    status = 503
    type = "service_unavailable"
    code = "no_healthy_backend"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(self.retry_after_s).encode())]


class Overloaded(NoHealthyBackend):
    """Flow control shed the request: its queue was full, or it waited too long."""

    code = "overloaded"


class RequestDropped(ProxyError):
    """The routing policy dropped the request (e.g. qos_drl: no expert can serve it
    without breaking the latency requirement of others)."""

    status = 503
    type = "service_unavailable"
    code = "request_dropped"


class UpstreamError(ProxyError):
    """Every backend tried failed before the response started."""

    status = 502
    type = "upstream_error"
    code = "upstream_failed"


def mid_stream_failure(backend: str, kind: str) -> UpstreamError:
    """The error reported in a stream whose backend failed after its first byte: its
    kind only (the exception's text, with addresses in it, goes to the log)."""
    return UpstreamError(f"Backend {backend} failed mid-stream ({kind}); "
                         "the response is incomplete.")


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


def error_json(err: ProxyError) -> bytes:
    return orjson.dumps(
        {
            "error": {
                "message": err.message,
                "type": err.type,
                "param": err.param,
                "code": err.code,
            }
        }
    )


# Anthropic's error types by HTTP status (docs.anthropic.com, Errors)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


def anthropic_error_json(err: ProxyError) -> bytes:
    """`err` in the Anthropic API's shape, for `/v1/messages` clients."""
    kind = _ANTHROPIC_TYPES.get(err.status, "invalid_request_error" if err.status < 500
                                else "api_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": err.message}})


def error_response(err: ProxyError, anthropic: bool = False
                   ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """(status, headers, body) of a JSON error response (Anthropic-shaped if asked)."""
    body = anthropic_error_json(err) if anthropic else error_json(err)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *err.headers(),
    ]
    return err.status, headers, body


def stream_error_event(err: ProxyError) -> bytes:
    """An SSE event reporting an error after the stream started, then `[DONE]`."""
    return b"data: " + error_json(err) + b"\n\ndata: [DONE]\n\n"


def responses_error_event(err: ProxyError) -> bytes:
    """The Responses API's in-stream error event (it has no `[DONE]`)."""
    return b"event: error\ndata: " + orjson.dumps({
        "type": "error", "code": err.code or err.type, "message": err.message,
        "param": err.param}) + b"\n\n"


def anthropic_error_event(err: ProxyError) -> bytes:
    """The Anthropic Messages API's in-stream error event."""
    return b"event: error\ndata: " + anthropic_error_json(err) + b"\n\n"
