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


def field_span(body: bytes, boundary: bytes, name: str) -> tuple[int, int] | None:
    """Where the value of the form field `name` (not a file) lies in `body`, or None
    when the body has no such field or is not well formed."""
    delimiter = b"--" + boundary
    at = body.find(delimiter)
    while at != -1:
        head_start = at + len(delimiter)
        if body[head_start:head_start + 2] != b"\r\n":  # "--": the closing delimiter
            return None
        head_end = body.find(b"\r\n\r\n", head_start, head_start + _MAX_HEAD)
        if head_end == -1:
            return None
        value_start = head_end + 4
        value_end = body.find(b"\r\n" + delimiter, value_start)
        if value_end == -1:
            return None
        if _is_field(body[head_start + 2:head_end], name):
            return value_start, value_end
        at = value_end + 2
    return None


def _is_field(head: bytes, name: str) -> bool:
    for line in head.split(b"\r\n"):
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-disposition":
            found = _NAME.search(value.split(b";", 1)[1] if b";" in value else b"")
            return (found is not None and found.group(1) == name.encode()
                    and b"filename" not in value.lower())
    return False


def replaced(body: bytes, span: tuple[int, int], value: str) -> bytes:
    """`body` with the field at `span` set to `value`."""
    return body[:span[0]] + value.encode() + body[span[1]:]
