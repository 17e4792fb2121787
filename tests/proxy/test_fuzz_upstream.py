"""Fuzzing the backend side: whatever a backend does to its answer, the client gets the
whole answer, or the backend's own refusal, and nothing is left behind.

A proxy (session affinity pinning every case to the misbehaving backend first,
migration of streamed and whole requests on, a 0.3 s stall deadline) sits in front of
a `Saboteur` (tests/proxy/saboteur.py: a fake vLLM's answers broken by a hypothesis
`Plan`) and a healthy fake. For each case the client must get:
* the backend's status, when the plan answers a 4xx (a client error, not retried);
* vLLM's refusal (a 400: in the stream after the tokens before it, or as the whole
  answer's status) when the plan refuses before the generation finished;
* otherwise exactly the healthy fake's answer (text and finish reason): a 5xx, a cut
  or silent connection, an unusable event, a lying length or broken chunking is a
  failure that the proxy retries or continues elsewhere, and re-chunked events,
  comments, CRLF line ends and events after [DONE] change nothing.
And always: an answer in the API's shape within the client's timeout, nothing logged at
ERROR, and afterwards no request left open on any backend (in-flight and tracked
streams back to 0). Once more with migration off, where the relay passes the bytes on
as they came and only the status and the transport are broken: the healthy fake's
answer, or a stream ending with the tokens it had, an error event and [DONE].
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.fakes.fake_vllm import FakeConfig, serve_fake
from bench.fakes.saboteur import Disruption, Plan, Saboteur
from tests.proxy.fakes import ADMIN, fleet
from tests.proxy.fuzzing import Errors, check_shape, fuzz, on_a_thread

JUNK = [b"{", b"", b"nul", b"[1, 2", b"\xff\xfe", b'{"choices": 5}',
        b'{"choices": [{"delta": 7}]}', b'{"choices": [{"text": ["x"], "index": 0}]}',
        b'{"choices": [{"token_ids": "x", "index": 0}]}',
        b'{"error": {"message": "boom", "type": "InternalServerError", "code": 500}}',
        b'{"choices": [{"index": 0, "finish_reason": "abort", "text": ""}]}']
FRACTION = st.floats(0, 1, allow_nan=False)
DISRUPTIONS = st.one_of(
    st.builds(Disruption, st.sampled_from(["cut", "stall", "badchunk"]), FRACTION),
    st.just(Disruption("unended")),
    st.builds(Disruption, st.just("garbage"), st.integers(0, 14).map(float),
              junk=st.sampled_from(JUNK)),
    st.builds(Disruption, st.just("refusal"), st.integers(0, 14).map(float)),
    st.builds(Disruption, st.just("truncate"), st.integers(0, 14).map(float),
              keep=st.integers(0, 400)),
    st.builds(Disruption, st.sampled_from(["short", "long"]), keep=st.integers(1, 200)),
)
_PLAN = {"cuts": st.lists(FRACTION, max_size=6).map(tuple), "comments": st.booleans(),
         "crlf": st.booleans(), "chunked": st.booleans(),
         "after_done": st.sampled_from([b"", b"{}", b"[DONE]", b"garbage"])}
# Another status, or a disruption: an error answer cut short is a failure like any other
PLANS = st.builds(Plan, status=st.sampled_from([400, 404, 422, 429, 500, 502, 503, 504]),
                  **_PLAN) | st.builds(Plan, disruption=st.none() | DISRUPTIONS, **_PLAN)
def expected_text(n: int) -> str:
    """The fakes' answer of `n` tokens."""
    return "".join(f"tok{i} " for i in range(n))


# (api, stream, tokens)
REQUESTS = st.tuples(st.sampled_from(["chat", "completions"]), st.booleans(), st.integers(1, 10))
ANY_API = st.tuples(st.sampled_from(["chat", "completions", "responses", "messages",
                                     "embeddings"]), st.booleans(), st.integers(1, 10))


@dataclass(frozen=True)
class Served:
    url: str
    direct: str  # the healthy fake
    saboteur: Saboteur
    errors: Errors
    session: str  # an x-session-id the ring gives the saboteur


def serving(migration: dict[str, Any]) -> Iterator[Served]:
    """The saboteur and a healthy fake behind a proxy with these migration settings, on
    a thread of their own."""

    @contextlib.asynccontextmanager
    async def setup() -> AsyncIterator[tuple[str, str, Saboteur]]:
        async with serve_fake(FakeConfig()) as behind, \
                Saboteur(behind.url).serving() as saboteur, \
                fleet(FakeConfig(), policy={"name": "session"},
                      extra_backends=[{"name": "bad", "url": saboteur.url, "model": "fake"}],
                      server={"header_timeout_s": 5},
                      upstream={"read_timeout_s": 0.3, "first_byte_timeout_s": 1.0},
                      outliers={"failures": 0},  # every case is the saboteur's first
                      migration=migration) as (proxy, fakes):
            yield proxy.url, fakes[0].url, saboteur

    with on_a_thread(setup) as ((url, direct, saboteur), errors):
        settle(url)
        yield Served(url, direct, saboteur, errors, session_on(url, "bad"))


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """Streamed and whole requests tracked (they may move)."""
    yield from serving({"enabled": True, "non_stream": True})


@pytest.fixture(scope="module")
def untracked() -> Iterator[Served]:
    """Migration off: streams relayed byte for byte, whole answers as they came."""
    yield from serving({"enabled": False})


def session_on(url: str, backend: str, model: str = "fake") -> str:
    """An x-session-id the proxy's session ring gives `backend` (one of `model`'s)."""
    with httpx.Client(base_url=url, timeout=60) as http:
        for i in range(200):
            answer = http.post("/v1/completions", json={"model": model, "prompt": "x",
                                                         "max_tokens": 1},
                               headers={"x-session-id": f"s{i}"})
            if answer.headers["x-laneway-backend"] == backend:
                return f"s{i}"
    raise AssertionError(f"no session id lands on {backend}")


def settle(url: str, timeout_s: float = 10.0) -> None:
    """Until every backend is healthy and has nothing open via the proxy."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=5) as http:
        while True:
            rows = http.get("/admin/backends", headers=ADMIN).json()["backends"]
            if all(r["healthy"] and not r["inflight"] and not r["tracked_streams"]
                   for r in rows):
                return
            assert time.monotonic() < deadline, rows
            time.sleep(0.02)


@dataclass
class Said:
    status: int
    text: str
    finish_reason: str | None
    error: dict[str, Any] | None  # an in-stream error event's


PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "responses": "/v1/responses", "messages": "/v1/messages",
         "embeddings": "/v1/embeddings"}


def said(api: str, stream: bool, answer: httpx.Response) -> Said:
    """What the answer says, in any of the APIs (`text`: an embedding's floats as text)."""
    if answer.status_code != 200:
        return Said(answer.status_code, "", None, None)
    if not stream:
        data = answer.json()
        if api in ("chat", "completions"):
            choice = data["choices"][0]
            return Said(200, choice["message"]["content"] if api == "chat" else choice["text"],
                        choice["finish_reason"], None)
        text = str(data["output"][0]["content"][0]["text"] if api == "responses"
                   else data["content"][0]["text"] if api == "messages"
                   else data["data"][0]["embedding"])
        return Said(200, text, data.get("status") or data.get("stop_reason"), None)
    out = Said(200, "", None, None)
    for line in answer.text.split("\n"):
        if not line.startswith("data: {"):
            continue
        event = orjson.loads(line[6:])
        kind = event.get("type")
        if kind == "error":  # the Responses and Messages APIs' error event
            out.error = event.get("error", event)
        elif kind == "response.output_text.delta":
            out.text += event["delta"]
        elif kind == "content_block_delta":
            out.text += event["delta"]["text"]
        elif kind in ("response.completed", "message_delta"):
            out.finish_reason = (event.get("response") or {}).get("status") \
                or event["delta"]["stop_reason"]
        out.error = event.get("error", out.error)
        for choice in event.get("choices") or ():
            out.text += (choice.get("delta") or {}).get("content") or "" if api == "chat" \
                else choice.get("text") or ""
            out.finish_reason = choice.get("finish_reason") or out.finish_reason
    return out


def ask(url: str, api: str, stream: bool, n: int, headers: dict[str, str] | None = None,
        model: str = "fake", extra: dict[str, Any] | None = None
        ) -> tuple[str, httpx.Response]:
    """`n` tokens of the API's answer to "hi" (`extra`: more body fields, e.g. greedy)."""
    bodies: dict[str, dict[str, Any]] = {
        "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": n},
        "completions": {"prompt": "hi", "max_tokens": n},
        "responses": {"input": "hi", "max_output_tokens": n},
        "messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": n},
        "embeddings": {"input": f"hi {n}"}}
    body = bodies[api]
    if api != "embeddings":
        body["stream"] = stream
    with httpx.Client(base_url=url, timeout=20) as http:
        return PATHS[api], http.post(PATHS[api], json={"model": model, **body, **(extra or {})},
                                     headers=headers or {})


def sabotaged(served: Served, plan: Plan, api: str, stream: bool, n: int
              ) -> tuple[Said, httpx.Response, bool]:
    """Ask through the proxy with `plan` on the saboteur, which the case must reach (an
    embedding goes to the backend with the fewest open requests, whatever the policy:
    maybe not); fail on what every case must not do (the module docstring). (What the
    answer says, the answer, whether it reached the saboteur.)"""
    settle(served.url)
    saboteur, before, hits = served.saboteur, len(served.errors.records), served.saboteur.hits
    saboteur.plan = plan
    try:
        path, answer = ask(served.url, api, stream, n, {"x-session-id": served.session})
    finally:
        saboteur.plan = None
    reached = saboteur.hits > hits
    assert reached or api == "embeddings", "the case never reached the saboteur"
    logged = served.errors.records[before:]
    assert not logged, [r.getMessage() for r in logged]
    check_shape(path, answer)
    return said(api, stream, answer), answer, reached


@fuzz(200)
@given(PLANS, REQUESTS)
def test_a_broken_backend_answer_reaches_the_client_whole_or_as_its_refusal(
        served: Served, plan: Plan, request: tuple[str, bool, int]) -> None:
    api, stream, n = request
    _, reference = ask(served.direct, api, stream, n)
    expected = said(api, stream, reference)
    saboteur, refusals = served.saboteur, served.saboteur.refusals
    got, answer, _ = sabotaged(served, plan, api, stream, n)
    if plan.status is not None and plan.status < 500:
        assert got.status == plan.status, answer.text
    elif saboteur.refusals > refusals:
        if stream:
            assert got.status == 200 and got.error is not None and got.error["code"] == 400
            assert expected.text.startswith(got.text), (got, expected)
        else:
            assert got.status == 400, answer.text
    else:
        assert (got.status, got.text, got.finish_reason, got.error) == (
            200, expected.text, expected.finish_reason, None), answer.text
    settle(served.url, timeout_s=5)  # nothing left open on any backend


# What an untracked relay cannot judge without reading the events (it passes them on as
# they came): only the transport is broken, and the status.
TRANSPORT = st.builds(Disruption, st.sampled_from(["cut", "stall", "badchunk"]), FRACTION) \
    | st.builds(Disruption, st.sampled_from(["short", "long"]), keep=st.integers(1, 200)) \
    | st.just(Disruption("unended"))
BYTES_ONLY = {**_PLAN, "after_done": st.just(b"")}
UNTRACKED_PLANS = st.builds(
    Plan, status=st.sampled_from([400, 404, 422, 429, 500, 502, 503, 504]), **BYTES_ONLY) \
    | st.builds(Plan, disruption=st.none() | TRANSPORT, **BYTES_ONLY)


@fuzz(200)
@given(UNTRACKED_PLANS, ANY_API)
def test_an_untracked_answer_broken_in_transport_is_retried_or_ends_with_an_error(
        untracked: Served, plan: Plan, request: tuple[str, bool, int]) -> None:
    """Before the first byte reaches the client the request is retried elsewhere (the
    healthy fake's answer); after it, a stream that cannot move ends with the tokens it
    had, an error event and [DONE]."""
    api, stream, n = request
    stream = stream and api != "embeddings"
    _, reference = ask(untracked.direct, api, stream, n)
    got, answer, reached = sabotaged(untracked, plan, api, stream, n)
    judge_untracked(plan, said(api, stream, reference), got, stream, answer, reached)
    settle(untracked.url, timeout_s=5)


def judge_untracked(plan: Plan, expected: Said, got: Said, stream: bool,
                    answer: httpx.Response, reached: bool = True) -> None:
    """The untracked property: the backend's 4xx (when the case reached it), or the
    healthy backend's answer, or a stream ending with the tokens it had and an error."""
    if reached and plan.status is not None and plan.status < 500:
        assert got.status == plan.status, answer.text
    elif got.error is not None:
        assert stream and got.status == 200, answer.text
        assert expected.text.startswith(got.text), (got, expected)
    else:
        assert (got.status, got.text, got.finish_reason) == (
            200, expected.text, expected.finish_reason), answer.text


def test_a_relayed_stream_cut_inside_an_event_never_passes_half_of_it_on(
        untracked: Served) -> None:
    """(Before, the client got the half event, its JSON cut off, and then the error.)"""
    got, answer, _ = sabotaged(untracked, Plan(disruption=Disruption("cut", 0.5)), "chat", True,
                            8)
    assert got.error is not None and got.error["code"] == "upstream_failed"
    assert 0 < len(got.text) < len(expected_text(8)) and expected_text(8).startswith(got.text)
    assert answer.text.endswith("data: [DONE]\n\n")


def test_a_body_that_breaks_after_done_is_a_whole_answer(untracked: Served) -> None:
    """(Before: the whole answer, and then an error event after its [DONE].)"""
    for disruption in (Disruption("long", keep=5), Disruption("cut", 0.999)):
        got, answer, _ = sabotaged(untracked, Plan(disruption=disruption), "completions", True, 6)
        assert (got.text, got.finish_reason, got.error) == (expected_text(6), "length", None)
        assert answer.text.count("data: [DONE]") == 1


@pytest.mark.parametrize("api", ["chat", "completions", "responses", "messages"])
@pytest.mark.parametrize("crlf", [False, True])
def test_a_stream_whose_last_event_has_no_blank_line_is_whole(
        untracked: Served, api: str, crlf: bool) -> None:
    """The body ended cleanly right after its last event, `[DONE]` or the Responses or
    Messages API's terminal event, but without the blank line that ends an event.
    (Before: for the Responses and Messages APIs, the tokens and an error event.)"""
    _, reference = ask(untracked.direct, api, True, 5)
    got, answer, _ = sabotaged(untracked, Plan(crlf=crlf, disruption=Disruption("unended")),
                               api, True, 5)
    assert got == said(api, True, reference) and got.error is None, answer.text
    assert answer.text.endswith("\n\n") and not answer.text.endswith("\n\n\n")


def test_a_whole_answer_cut_short_or_stuck_is_retried_not_relayed(untracked: Served) -> None:
    """A body without a length that ends early, or shorter than its content-length, is
    complete as HTTP goes but not JSON (before: relayed with its 200); one whose chunk
    size is not hex left aiohttp's C parser waiting for ever, past its own read timeout
    (before: the request hung), and is now given up after `read_timeout_s`."""
    for plan in (Plan(chunked=False, disruption=Disruption("cut", 0.0)),
                 Plan(chunked=False, disruption=Disruption("cut", 0.6)),
                 Plan(chunked=False, disruption=Disruption("short", keep=10)),
                 Plan(cuts=(0.5, 0.75), disruption=Disruption("badchunk", 0.75))):
        started = time.monotonic()
        got, answer, _ = sabotaged(untracked, plan, "chat", False, 6)
        assert (got.status, got.text) == (200, expected_text(6)), answer.text
        assert answer.headers["x-laneway-backend"] == "f0"
        assert time.monotonic() - started < 5
