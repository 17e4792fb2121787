"""The one form field the proxy reads in a `multipart/form-data` body, and its rewrite.

The audio routes (`/v1/audio/transcriptions`, `/translations`) take an upload: the audio
file and the request's fields as parts of a form (RFC 7578). Routing needs only the
`model` part, so the body is scanned for it, not parsed: the file's bytes are never
copied or decoded, and the body is relayed as it came (but for the model's name when a
group's member or a fallback answers).
"""

from __future__ import annotations

import re

from proxy.errors import InvalidRequest

_BOUNDARY = re.compile(r'boundary=(?:"([^"]+)"|([^;\s]+))', re.IGNORECASE)
_MAX_HEAD = 16 * 1024  # a part's headers


def boundary_of(content_type: str) -> bytes | None:
    """The boundary of a `multipart/form-data` content type, None for any other."""
    if not content_type.lower().startswith("multipart/form-data"):
        return None
    found = _BOUNDARY.search(content_type)
    return None if found is None else (found.group(1) or found.group(2)).encode("latin-1")


def field_spans(body: bytes, boundary: bytes, *names: str) -> dict[str, tuple[int, int]]:
    """Where the values of the form fields `names` (not files) lie in `body`.

    Every part is read as the backend's form parser (vLLM: FastAPI, so starlette on
    python-multipart) reads it, so that both see the same value: a part's
    `Content-Disposition` parameters quoted or not, their names in any case, `name*=`
    ignored. What the two could read differently is a 400 (`InvalidRequest`): one of
    `names` sent twice (the proxy would route by one, the backend serve the other), a
    part with two `Content-Disposition` headers or a parameter twice, a part without a
    name, a form not well formed."""
    delimiter = b"--" + boundary
    spans: dict[str, tuple[int, int]] = {}
    seen: set[str] = set()
    at = body.find(delimiter)
    while at != -1:
        head_start = at + len(delimiter)
        if body[head_start:head_start + 2] == b"--":  # the closing delimiter
            return spans
        head_end = body.find(b"\r\n\r\n", head_start, head_start + _MAX_HEAD)
        value_end = body.find(b"\r\n" + delimiter, head_end + 4)
        if body[head_start:head_start + 2] != b"\r\n" or head_end == -1 or value_end == -1:
            break
        name, is_file = _disposition(body[head_start + 2:head_end])
        if name in names:
            if name in seen:
                raise InvalidRequest(f"The form field `{name}` is sent more than once.",
                                     param=name)
            seen.add(name)
            if not is_file:
                spans[name] = (head_end + 4, value_end)
        at = value_end + 2
    raise InvalidRequest("The multipart/form-data body is not well formed (each part: "
                         "its headers, a blank line, its value; then the closing "
                         "delimiter).")


def _disposition(head: bytes) -> tuple[str, bool]:
    """(the `name` of a part, whether it is a file) from its headers."""
    found: list[bytes] = []
    for line in head.split(b"\r\n"):
        key, colon, value = line.partition(b":")
        if not colon:
            raise InvalidRequest("A part of the form has a header line without a colon.")
        if key.strip().lower() == b"content-disposition":
            found.append(value)
    if len(found) != 1:
        raise InvalidRequest("Each part of the form needs exactly one Content-Disposition "
                             f"header (one has {len(found)}).")
    params = _params(found[0].decode("latin-1"))
    if len(params) != len(dict(params)):
        raise InvalidRequest("A part of the form names a Content-Disposition parameter "
                             "twice.")
    options = dict(params)
    if "name" not in options:
        raise InvalidRequest("A part of the form has no `name` in its Content-Disposition.")
    raw = options["name"].encode("latin-1")
    try:
        name = raw.decode()
    except UnicodeDecodeError:
        name = raw.decode("latin-1")
    return name, "filename" in options


def _params(value: str) -> list[tuple[str, str]]:
    """The parameters of a header value, as python-multipart's `parse_options_header`
    reads them (`;` inside quotes is no separator; names lower-cased; `name*` ones
    dropped; quoted values unquoted), in order, repeats kept."""
    params: list[tuple[str, str]] = []
    for segment in _segments(value)[1:]:
        key, _, val = segment.partition("=")
        if "*" in key:
            continue
        if len(val) >= 2 and val[0] == '"' and val[-1] == '"':
            val = val[1:-1].replace("\\\\", "\\").replace('\\"', '"')
        params.append((key, val))
    return params


def _segments(value: str) -> list[str]:
    """`value` split at the `;` outside quotes (python-multipart's `_parseparam`)."""
    text = ";" + value
    segments: list[str] = []
    start = 0
    while text.find(";", start) == start:
        start += 1
        end = text.find(";", start)
        ind, diff = start, 0
        while end > 0:
            diff += text.count('"', ind, end) - text.count('\\"', ind, end)
            if diff % 2 == 0:
                break
            end, ind = ind, text.find(";", end + 1)
        if end < 0:
            end = len(text)
        i = text.find("=", start, end)
        segment = text[start:end] if i == -1 else \
            text[start:i].rstrip(" \t").lower() + "=" + text[i + 1:end].lstrip(" \t")
        segments.append(segment.strip(" \t"))
        start = end
    return segments


def replaced(body: bytes, span: tuple[int, int], value: str) -> bytes:
    """`body` with the field at `span` set to `value`."""
    return body[:span[0]] + value.encode() + body[span[1]:]
