"""Fuzzing the request path: whatever a client sends, the proxy answers it, in time,
with a success or an error in the API's own shape, and never fails itself.

Hypothesis builds the requests: valid bodies of every generation and pass-through
route with fields set to values of any JSON type, or deleted; bodies that are not JSON
objects; random headers the proxy reads. A proxy with migration, forced moves, the
access log and prefix-aware routing on (so that every part that reads a body runs)
answers them from a thread of its own, in front of two fakes. What fails a case: a 500,
an error that is not OpenAI-shaped (Anthropic-shaped on /v1/messages), a stream that
does not end, no answer within the client's timeout, or anything the proxy logged at
ERROR (its last-resort handler logs every exception it catches). The same
properties against a real vLLM server: tests/integration/test_fuzz_vllm.py.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.fakes.fake_vllm import FakeConfig
from policies.base import POLICIES
from proxy.errors import InvalidRequest, ProxyError
from proxy.http import multipart
from proxy.migration.eligibility import (
    continuation_body,
    penalty_bias,
    tokenize_bodies,
    tracked_body,
    tracking_of,
    why_not_migratable,
)
from proxy.request_context import build_context, parse_body
from proxy.types import Endpoint
from tests.policies.test_params_edges import cases as policy_cases
from tests.proxy.admission.test_auth import keys
from tests.proxy.fakes import ADMIN as ADMIN_HEADERS
from tests.proxy.fakes import ADMIN_TOKEN, fleet
from tests.proxy.fuzzing import (
    BASES,
    CASES,
    CHAT,
    JSON,
    MESSAGES,
    NOT_OBJECTS,
    Errors,
    check_shape,
    dumps,
    fuzz,
    on_a_thread,
)


@dataclass(frozen=True)
class Served:
    url: str
    errors: Errors


def serving(**sections: Any) -> Iterator[Served]:
    """A proxy (`sections`: its settings) and its fakes on a thread of their own."""
    with on_a_thread(lambda: fleet(FakeConfig(), FakeConfig(tpot_s=0.001), **sections)
                     ) as ((proxy, _), errors):
        yield Served(proxy.url, errors)


ADMIN_JSON = {**ADMIN_HEADERS, "content-type": "application/json"}  # the admin API's
SERVER = {"access_log": True, "max_tokens_limit": 64, "header_timeout_s": 5,
          "body_timeout_s": 0.5}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """Migration, forced moves, the access log and prefix-aware routing on."""
    yield from serving(server=SERVER, policy={"name": "prefix_aware"},
                       migration={"enabled": True, "non_stream": True},
                       debug={"allow_forced_migration": True},
                       admin={"token": ADMIN_TOKEN, "backend_allowlist": ["127.0.0.0/8"]})


@pytest.fixture(scope="module")
def guarded() -> Iterator[Served]:
    """Keys (one limited to another model, one with request and token limits), flow
    control (two open requests a backend, a short queue) and the goodput policy."""
    yield from serving(server=SERVER, policy={"name": "goodput"},
                       auth=keys(requests_per_minute=10**6, tokens_per_minute=10**7,
                                 priority=2),
                       flow_control={"max_inflight_per_backend": 2, "max_queued": 50,
                                     "queue_timeout_s": 5})


def check_answer(served: Served, path: str, body: bytes, headers: dict[str, str]) -> None:
    """Send one case; fail it on anything the module docstring lists."""
    before = len(served.errors.records)
    with httpx.Client(base_url=served.url, timeout=20) as http:
        answer = http.post(path, content=body, headers=headers)
    logged = served.errors.records[before:]
    assert not logged, [r.getMessage() for r in logged]
    assert answer.status_code != 500, answer.text
    check_shape(path, answer)


@fuzz(400)
@given(CASES)
def test_any_body_gets_an_answer_in_the_apis_shape(
        served: Served, case: tuple[str, bytes, dict[str, str]]) -> None:
    check_answer(served, *case)


KEYS = st.sampled_from([{"authorization": "Bearer sk-alice"}, {"x-api-key": "sk-alice"},
                        {"authorization": "Bearer sk-bob"}, {"authorization": "Bearer x"},
                        {}])


@fuzz(200)
@given(CASES, KEYS)
def test_any_body_with_keys_limits_and_flow_control_is_answered_in_shape(
        guarded: Served, case: tuple[str, bytes, dict[str, str]], key: dict[str, str]
        ) -> None:
    path, body, headers = case
    check_answer(guarded, path, body, {**headers, **key})


@fuzz(150)
@given(NOT_OBJECTS)
def test_a_body_that_is_not_a_json_object_is_a_400(
        served: Served, case: tuple[str, bytes, dict[str, str]]) -> None:
    path, body, headers = case
    check_answer(served, path, body, headers)
    with httpx.Client(base_url=served.url, timeout=20) as http:
        assert http.post(path, content=body, headers=headers).status_code in (400, 401, 413)


ENDPOINTS: dict[str, Endpoint] = {"/v1/chat/completions": "chat",
                                  "/v1/completions": "completions",
                                  "/v1/responses": "responses", "/v1/messages": "messages"}


@fuzz(3000)
@given(CASES.filter(lambda case: case[0] in ENDPOINTS))
def test_what_reads_a_body_raises_nothing_but_a_proxy_error(
        case: tuple[str, bytes, dict[str, str]]) -> None:
    """The request path's readers of a body, alone (cheap, so many more cases): its
    parse, and for a request it accepts, the migration's decision and bodies (the
    tracked first request, a continuation, the penalties carried over, the /tokenize
    bodies of a move between tokenizers)."""
    path, body, headers = case
    try:
        data = parse_body(body)
        ctx = build_context(data, ENDPOINTS[path], headers, request_id="r",
                            max_tokens_limit=64, session_header="x-session-id",
                            block_chars=8)
    except ProxyError:
        return
    chat = ctx.endpoint == "chat"
    if ctx.endpoint in ("chat", "completions") and why_not_migratable(data, chat) is None:
        tracking = tracking_of(data, ctx.max_tokens)
        orjson.loads(tracked_body(data, tracking))
        orjson.loads(continuation_body(data, tracking, "m", [1, 7, 100, 101], 2, context=99))
        penalty_bias(data, [100, 101, 101])
        tokenize_bodies(data, chat, "m", "tok0 tok1")


@fuzz(1500)
@given(st.binary(max_size=200), st.text(max_size=60))
def test_a_form_upload_of_any_bytes_is_scanned_without_failing(
        body: bytes, content_type: str) -> None:
    boundary = multipart.boundary_of("multipart/form-data; " + content_type)
    try:
        spans = multipart.field_spans(body, boundary or b"b", "model", "stream")
    except InvalidRequest:  # a form the backend could read otherwise, or not at all
        return
    for start, end in spans.values():
        assert 0 <= start <= end <= len(body)


TOKEN = st.text(st.characters(codec="ascii", categories=["L", "N"], include_characters="-_."),
               min_size=1, max_size=12)
PART = st.tuples(st.sampled_from(["model", "stream", "file", "language", "Model"]) | TOKEN,
                 st.binary(max_size=40), st.booleans())  # name, value, a file's part


@fuzz(1500)
@given(TOKEN.map(lambda t: "bnd" + t), st.lists(PART, max_size=6), st.booleans())
def test_a_form_field_is_found_where_the_form_puts_it(
        boundary: str, parts: list[tuple[str, bytes, bool]], quoted: bool) -> None:
    """A form written as RFC 7578 writes it, parts in any order, with files among them:
    the scan finds the `model` and `stream` fields (not a file's part of that name)
    exactly, and a replaced model leaves every other byte as it was; a form naming one
    of them twice is refused (the backend reads the last, laneway would route by one)."""
    delimiter = b"--" + boundary.encode()
    parts = [(n, v, f) for n, v, f in parts if delimiter not in v and b"\r\n--" not in v]
    body = b"".join(
        delimiter + b'\r\nContent-Disposition: form-data; name="%s"%s\r\n%s\r\n%s\r\n'
        % (name.encode(), b'; filename="a.wav"' if file else b"",
           b"Content-Type: audio/wav\r\n" if file else b"", value)
        for name, value, file in parts) + delimiter + b"--\r\n"
    header = f'multipart/form-data; boundary="{boundary}"' if quoted \
        else f"multipart/form-data; boundary={boundary}"
    assert multipart.boundary_of(header) == boundary.encode()
    if any([n for n, _, _ in parts].count(name) > 1 for name in ("model", "stream")):
        with pytest.raises(InvalidRequest):
            multipart.field_spans(body, boundary.encode(), "model", "stream")
        return
    spans = multipart.field_spans(body, boundary.encode(), "model", "stream")
    for name in ("model", "stream"):
        value = next((v for n, v, f in parts if n == name and not f), None)
        assert (body[slice(*spans[name])] if name in spans else None) == value, name
    if "model" in spans:
        renamed = multipart.replaced(body, spans["model"], "other")
        start, end = spans["model"]
        assert renamed == body[:start] + b"other" + body[end:]


# A policy as an operator may PUT it: each policy with each of its fields at the edges
# of its type (tests/policies/test_params_edges.py), or a body of any JSON.
POLICY_PUTS = st.sampled_from(policy_cases()).map(lambda c: {"name": c[0], "params": c[1]}) \
    | st.fixed_dictionaries({"name": st.sampled_from(sorted(POLICIES)) | JSON,
                             "params": JSON}) | JSON


ROUTED = st.sampled_from([
    ("/v1/chat/completions", {**CHAT, "max_tokens": 6}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 6, "stream": True}),
    ("/v1/completions", {"model": "fake", "prompt": "x", "stream": True}),
    ("/v1/messages", MESSAGES)])


@fuzz(150)
@given(POLICY_PUTS, st.lists(st.tuples(ROUTED, st.sampled_from(
    [{}, {"x-laneway-slo-ms": "5000"}, {"x-laneway-slo-ms": "1"}])), min_size=1, max_size=3))
def test_any_policy_the_admin_api_accepts_routes_without_failing(
        served: Served, policy: Any,
        requests: list[tuple[tuple[str, dict[str, Any]], dict[str, str]]]) -> None:
    with httpx.Client(base_url=served.url, timeout=20, headers=ADMIN_JSON) as http:
        put = http.put("/admin/policy", content=dumps(policy))
        try:
            assert put.status_code in (200, 400), put.text
            for (path, body), headers in requests:
                check_answer(served, path, dumps(body), headers)
        finally:
            http.put("/admin/policy", json={"name": "prefix_aware"})


# The admin API's other bodies: a backend to add (its fields of any JSON, or plausible:
# an address nothing listens on), a drain's or a removal's `{"migrate"}`, an adapter.
BACKEND = st.fixed_dictionaries({}, optional={
    "name": st.sampled_from(["fz", "f0", ""]) | JSON,
    "url": st.sampled_from(["http://127.0.0.1:9", "not a url", "ftp://x"]) | JSON,
    "model": st.sampled_from(["fake", "fz-model", ""]) | JSON,
    "labels": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2) | JSON,
    "api_key": JSON})
ADMIN = st.one_of(
    st.tuples(st.just("POST"), st.just("/admin/backends"), BACKEND | JSON),
    st.tuples(st.sampled_from(["POST"]), st.sampled_from(
        ["/admin/backends/f1/drain", "/admin/backends/f1/undrain"]),
        st.fixed_dictionaries({}, optional={"migrate": st.booleans() | JSON}) | JSON),
    st.tuples(st.just("POST"), st.just("/admin/lora_adapters"), st.fixed_dictionaries(
        {}, optional={"lora_name": JSON, "lora_path": JSON, "model": JSON,
                      "backends": JSON, "timeout_s": JSON}) | JSON),
    st.tuples(st.just("DELETE"), st.sampled_from(["/admin/lora_adapters/x",
                                                  "/admin/backends/fz"]), JSON))


@fuzz(150)
@given(ADMIN)
def test_any_admin_body_is_answered_in_shape_and_leaves_the_fleet_serving(
        served: Served, case: tuple[str, str, Any]) -> None:
    method, path, body = case
    before = len(served.errors.records)
    with httpx.Client(base_url=served.url, timeout=20, headers=ADMIN_JSON) as http:
        try:
            answer = http.request(method, path, content=dumps(body))
            assert answer.status_code < 500 or answer.status_code == 502, answer.text
            if answer.status_code >= 400:
                assert isinstance(answer.json()["error"]["message"], str), answer.text
        finally:  # as it was: no backend added, none drained
            http.request("DELETE", "/admin/backends/fz", content=b'{"migrate": false}')
            http.post("/admin/backends/f1/undrain")
        check_answer(served, "/v1/chat/completions", dumps(CHAT), {})
    logged = served.errors.records[before:]
    assert not logged, [r.getMessage() for r in logged]


# Raw HTTP/1.1 as any client (or scanner) may write it: a method, a path with
# escapes, headers that contradict each other or the body.
SEGMENT = st.sampled_from(["v1", "chat", "completions", "responses", "admin", "backends",
                           "policy", "f0", "drain", "cancel", "..", ".", "", "%2F", "%00",
                           "resp_1", "%3Fstream=true", "metrics", "health", "x" * 300])
PATH = st.lists(SEGMENT, min_size=1, max_size=5).map(lambda parts: "/" + "/".join(parts)) \
    | st.sampled_from(["/v1/responses/..", "/v1/responses/.", "/v1/responses/a%2F..%2Fb",
                       "/v1/responses/x%3Fstream=true/cancel", "/admin/backends/%2E%2E",
                       "/v1/chat/completions?x=%ff", "*"])
RAW_HEADER = st.tuples(
    st.sampled_from(["content-length", "transfer-encoding", "content-type", "expect",
                     "x-laneway-slo-ms", "authorization", "host", "connection"]),
    st.sampled_from(["0", "5", "-1", "99999999999999999999", "chunked", "gzip", "abc",
                     "application/json", "multipart/form-data; boundary=b",
                     "100-continue", "close", ""]))


@st.composite
def raw_request(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A request's bytes, and whether its framing is right (a content-length that is
    the body's, no transfer-encoding): then a request after it on the connection must
    be read as one."""
    method = draw(st.sampled_from(["POST", "POST", "GET", "PUT", "DELETE", "OPTIONS",
                                   "PATCH", "HEAD", "BREW"]))
    path = draw(PATH | st.sampled_from(sorted(BASES)))
    body = draw(st.sampled_from([b"", dumps(CHAT), b"5\r\nhello\r\n0\r\n\r\n", b"zz\r\n"])
                | st.binary(max_size=30))
    head = [f"{method} {path} HTTP/1.1", "host: laneway"]
    framed = draw(st.booleans())  # half of them framed right, the other half any way
    if framed:
        head.append(f"content-length: {len(body)}")
        head += [f"{k}: {v}" for k, v in draw(st.lists(RAW_HEADER.filter(
            lambda h: h[0] not in ("content-length", "transfer-encoding")), max_size=2))]
    else:
        head += [f"{k}: {v}" for k, v in draw(st.lists(RAW_HEADER, max_size=4))]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body, framed


NEXT = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: laneway\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(dumps(CHAT)), dumps(CHAT)))


def answers(conn: socket.socket, count: int, head_only: bool) -> list[tuple[bytes, bytes]]:
    """Up to `count` answers (status line + headers, body) read from `conn`, fewer if
    it closes first. Bodies are framed by content-length, as the proxy frames every
    answer that is not a stream (`head_only`: the first is a HEAD's, without one)."""
    data, found = b"", []
    with contextlib.suppress(ConnectionResetError):
        while len(found) < count:
            if b"\r\n\r\n" in data:
                head, rest = data.split(b"\r\n\r\n", 1)
                lines = head.lower().split(b"\r\n")
                size = next((int(line.split(b":", 1)[1]) for line in lines[1:]
                             if line.startswith(b"content-length:")), 0)
                if lines[0].startswith(b"http/1.1 1"):  # (`expect`'s go-ahead)
                    data = rest
                    continue
                if lines[0].startswith(b"http/1.1 204") or (head_only and not found):
                    size = 0
                if len(rest) >= size:
                    found.append((head, rest[:size]))
                    data = rest[size:]
                    continue
            chunk = conn.recv(65536)  # (a timeout: neither answered nor closed)
            if not chunk:
                break
            data += chunk
    return found


@fuzz(300)
@given(raw_request())
def test_any_raw_request_is_answered_or_closed_in_time(served: Served,
                                                       case: tuple[bytes, bool]) -> None:
    """Within the header and body deadlines (5 s and 0.5 s here) every connection gets an
    answer that is not a 500, or is closed. Behind a well-framed request comes a valid
    one on the same connection: unless the first answer closed the connection, it is
    answered in full (a body left unread would be parsed as the next request)."""
    raw, framed = case
    before = len(served.errors.records)
    host, port = served.url.removeprefix("http://").split(":")
    head_only = raw.startswith(b"HEAD ")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(raw + NEXT if framed else raw)
        got = answers(conn, 2 if framed else 1, head_only)
    for head, _ in got:
        assert head.startswith(b"HTTP/1.1 ") and not head.startswith(b"HTTP/1.1 500"), head
    if framed and got and b"connection: close" not in got[0][0].lower():
        assert len(got) == 2, got
        assert got[1][0].startswith(b"HTTP/1.1 200 OK"), got[1]
        assert orjson.loads(got[1][1])["object"] == "chat.completion", got[1]
    logged = served.errors.records[before:]
    assert not logged, [r.getMessage() for r in logged]
