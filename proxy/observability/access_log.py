"""The access log (`server.access_log`) and the log format (`server.log_format`).

One line per HTTP request, when its answer ends, on the logger `laneway.access` at
INFO: method, path, status (499: the client left before an answer), the whole time and
the time to the first body byte (ms), the bytes sent, the backend that answered
(`x-laneway-backend`), the request id, the client address, and what the handler noted
(`note`): the request's model, the client key's name, the policy, prompt and completion
tokens, migrations, `client_left` (a stream the client abandoned), `stream_failed` (a 200
stream that ended with an error event), `trace_id` (with tracing). In text format the
fields follow the message as `key=value`; with `server.log_format: json` every log line
(access or not) is one JSON object, with these fields as keys, for Loki, Elasticsearch
and the like.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import orjson

from proxy.asgi import Message, Receive, Scope, Send

log = logging.getLogger("laneway.access")
NOTES = "laneway.access"  # the scope key of a request's notes, while the log is on
Http = Callable[[Scope, Receive, Send], Awaitable[None]]


def wait_ms(seconds: float) -> float | None:
    """A wait for the log line: milliseconds, or None (left out) under one."""
    return round(seconds * 1000, 1) if seconds >= 0.001 else None


def note(scope: Scope, **fields: Any) -> None:
    """Add `fields` to the request's access log line (nothing when the log is off)."""
    notes = scope.get(NOTES)
    if notes is not None:
        notes.update((k, v) for k, v in fields.items() if v is not None)


async def logged(app: Http, scope: Scope, receive: Receive, send: Send) -> None:
    """Run `app` on the request and log its line when the answer has ended (or failed)."""
    started = time.monotonic()
    notes: dict[str, Any] = {}
    scope[NOTES] = notes
    answer: dict[str, Any] = {"status": 499, "bytes": 0}
    first_byte: list[float] = []

    async def watched(message: Message) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
            for name, value in message.get("headers", ()):
                if name == b"x-laneway-backend":
                    answer["backend"] = value.decode("latin-1")
                elif name == b"x-request-id":
                    answer["request_id"] = value.decode("latin-1")
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            if body and not first_byte:
                first_byte.append(time.monotonic())
            answer["bytes"] += len(body)
        await send(message)

    try:
        await app(scope, receive, watched)
    except Exception:
        if "backend" not in answer and answer["status"] == 499:
            answer["status"] = 500  # the server answers it (nothing was sent yet)
        raise
    finally:
        now = time.monotonic()
        fields = {"method": scope["method"], "path": scope["path"], **answer,
                  "ms": round((now - started) * 1000, 2)}
        if first_byte:
            fields["first_byte_ms"] = round((first_byte[0] - started) * 1000, 2)
        client = scope.get("client")
        if client:
            fields["client"] = client[0]
        fields.update(notes)
        log.info("%s %s %d", scope["method"], scope["path"], answer["status"],
                 extra={"fields": fields})


# What could end or rewrite a log line in a terminal or a log viewer: C0 and C1
# controls (CR, LF, ESC, NEL, ...), DEL, Unicode's line and paragraph separators; and
# the backslash, so that an escape in the log is never the client's own text.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))} | {
    0x2028: "\\u2028", 0x2029: "\\u2029", ord("\\"): "\\\\"}
_QUOTED = {**_ESCAPES, ord('"'): '\\"'}


def printable(text: str) -> str:
    """`text` on one line, its control characters escaped (`\\x0a`), as every text log
    line shows what a client sent (a path, a model name): it cannot forge lines."""
    return text.translate(_ESCAPES)


class TextFormatter(logging.Formatter):
    """The usual line, then the record's fields (if any) as `key=value`; the message
    and the fields escaped (`printable`), a traceback after them with every line indented
    and escaped, so no text inside one (an exception's message may quote a client) can
    pass for a line of its own."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:
        return "\n".join("  " + printable(line)
                         for line in super().formatException(ei).splitlines())

    def formatStack(self, stack_info: str) -> str:
        return "\n".join("  " + printable(line) for line in stack_info.splitlines())

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if not fields:
            return line
        return line + " " + " ".join(f"{k}={_text(v)}" for k, v in fields.items()
                                     if k not in ("method", "path", "status"))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the record's fields and
    the exception (if any)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds"),
            "level": record.levelname.lower(), "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(level: str, fmt: str = "text") -> None:
    """The root logger at `level`, writing to stderr in `fmt` (text | json)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def _text(value: Any) -> str:
    """A field's value: as is if plain, else quoted, with quotes and controls escaped
    (a value cannot close its quotes and add a field of its own)."""
    text = str(value)
    if text and not any(c in text for c in ' "=') and text.isprintable():
        return printable(text)
    return '"' + text.translate(_QUOTED) + '"'
