"""The one form field the proxy reads in a `multipart/form-data` body, and its rewrite.

The audio routes (`/v1/audio/transcriptions`, `/translations`) take an upload: the audio
file and the request's fields as parts of a form (RFC 7578). Routing needs only the
`model` part, so the body is scanned for it, not parsed: the file's bytes are never
copied or decoded, and the body is relayed as it came (but for the model's name when a
group's member or a fallback answers).
"""

from __future__ import annotations

import re

_BOUNDARY = re.compile(r'boundary=(?:"([^"]+)"|([^;\s]+))', re.IGNORECASE)
_NAME = re.compile(rb'(?:^|;)\s*name="([^"]*)"', re.IGNORECASE)
_MAX_HEAD = 16 * 1024  # a part's headers


def boundary_of(content_type: str) -> bytes | None:
    """The boundary of a `multipart/form-data` content type, None for any other."""
    if not content_type.lower().startswith("multipart/form-data"):
        return None
    found = _BOUNDARY.search(content_type)
    return None if found is None else (found.group(1) or found.group(2)).encode("latin-1")


def field_spans(body: bytes, boundary: bytes, *names: str) -> dict[str, tuple[int, int]]:
    """Where the values of the form fields `names` (not files) lie in `body`, in one pass
    that stops once all are found; a name the body lacks (or a body that is not well
    formed from there on) is left out."""
    delimiter = b"--" + boundary
    spans: dict[str, tuple[int, int]] = {}
    at = body.find(delimiter)
    while at != -1 and len(spans) < len(names):
        head_start = at + len(delimiter)
        if body[head_start:head_start + 2] != b"\r\n":  # "--": the closing delimiter
            break
        head_end = body.find(b"\r\n\r\n", head_start, head_start + _MAX_HEAD)
        if head_end == -1:
            break
        value_start = head_end + 4
        value_end = body.find(b"\r\n" + delimiter, value_start)
        if value_end == -1:
            break
        name = _field_name(body[head_start + 2:head_end])
        if name in names and name not in spans:
            spans[name] = (value_start, value_end)
        at = value_end + 2
    return spans


def _field_name(head: bytes) -> str | None:
    """The `name` of a part that is a form field (not a file), from its headers."""
    for line in head.split(b"\r\n"):
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-disposition":
            found = _NAME.search(value.split(b";", 1)[1] if b";" in value else b"")
            if found is None or b"filename" in value.lower():
                return None
            return found.group(1).decode(errors="replace")
    return None


def replaced(body: bytes, span: tuple[int, int], value: str) -> bytes:
    """`body` with the field at `span` set to `value`."""
    return body[:span[0]] + value.encode() + body[span[1]:]
