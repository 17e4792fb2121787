"""Hypothesis strategies for requests as any client may write them, and the checks of
what the proxy answers them (tests/proxy/test_fuzz.py; against real vLLM
tests/integration/test_fuzz_vllm.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import httpx
import orjson
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from bench.harness.threaded import in_a_thread

MODEL = "fake"  # the model the bodies name unless told another (the fakes' name)

# Any JSON value, small: what a field may be set to.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=8)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"]) | JSON,
     "content": st.text(max_size=20) | st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url", "input_audio"]) | JSON,
          "text": st.text(max_size=10) | JSON}), max_size=2) | JSON},
    optional={"name": JSON, "tool_calls": JSON, "tool_call_id": JSON})

# Each route's valid body, and the fields (its own and the ones the proxy reads) that a
# case may change: to a plausible value or to any JSON.
CHAT: dict[str, Any] = {"model": MODEL, "messages": [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "hi"},
                                 {"type": "text", "text": " there"}]},
    {"role": "assistant", "content": "hello", "tool_calls": []},
    {"role": "user", "content": "again"}]}
MESSAGES: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "system": [
    {"type": "text", "text": "be brief"}], "messages": [
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]}
BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": MODEL, "prompt": "once upon a time"},
    "/v1/responses": {"model": MODEL, "instructions": "be brief", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]},
    "/v1/messages": MESSAGES,
    "/v1/embeddings": {"model": MODEL, "input": ["a text", "another"]},
    "/tokenize": {"model": MODEL, "messages": CHAT["messages"]},
    "/v1/messages/count_tokens": {k: v for k, v in MESSAGES.items() if k != "max_tokens"},
}
SMALL_INT = st.integers(-3, 40)
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([MODEL, MODEL, "nope", "", MODEL.upper()]),
    "messages": st.lists(MESSAGE, max_size=3),
    "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 70_000), max_size=6)
    | st.lists(st.text(max_size=8), max_size=3),
    "input": st.text(max_size=30) | st.lists(MESSAGE, max_size=2),
    "system": st.text(max_size=10) | st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2),
    "instructions": st.text(max_size=10),
    "max_tokens": SMALL_INT, "max_completion_tokens": SMALL_INT,
    "max_output_tokens": SMALL_INT, "min_tokens": SMALL_INT, "n": st.integers(0, 3),
    "best_of": st.integers(0, 3), "logprobs": st.booleans() | st.integers(0, 5),
    "top_logprobs": st.integers(0, 5), "echo": st.booleans(),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans() | JSON,
                      "continuous_usage_stats": st.booleans() | JSON}),
    "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "top_k": SMALL_INT,
    "seed": st.integers(-(2**64), 2**64), "stop": st.text(max_size=4)
    | st.lists(st.text(max_size=4), max_size=3),
    "ignore_eos": st.booleans(), "return_token_ids": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 99).map(str), st.floats(-100, 100),
                                  max_size=3),
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"])}),
    "tools": JSON, "tool_choice": JSON, "user": st.text(max_size=8),
    "kv_transfer_params": JSON, "prompt_embeds": JSON, "previous_response_id":
    st.text(max_size=12), "store": st.booleans(), "priority": SMALL_INT,
    "include_reasoning": st.booleans(),
}
HEADER_VALUE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=12).map(
    str.strip)  # HTTP drops the white space around a value
HEADERS = st.dictionaries(st.sampled_from([
    "x-laneway-slo-ms", "x-laneway-expected-tokens", "x-laneway-priority", "x-session-id",
    "x-request-id", "x-laneway-migrate-after", "x-laneway-events", "x-laneway-backend",
    "authorization", "x-api-key", "x-laneway-budget", "x-laneway-read-rate"]),
    HEADER_VALUE | st.sampled_from(["1", "0", "250", "-1"]),
    max_size=4)
# A move after the first tokens, forced (with `debug.allow_forced_migration`), in a
# third of the cases: the migration path reads the body again to continue it elsewhere.
MOVES = st.sampled_from([{}, {}, {"x-laneway-migrate-after": "2"},
                         {"x-laneway-migrate-after": "5"}])


def dumps(value: Any) -> bytes:
    """JSON as a client may write it: integers of any size (orjson's stop at 64 bits)."""
    return json.dumps(value).encode()


def paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place inside `value` (a key's or an index's path), itself first."""
    inner = value.items() if isinstance(value, dict) else (
        enumerate(value) if isinstance(value, list) else ())
    return [at, *(p for key, item in inner for p in paths(item, (*at, key)))]


def replaced(value: Any, at: tuple[Any, ...], new: Any) -> Any:
    """`value` with what lies at `at` set to `new` (or removed, for `DELETE`)."""
    if not at:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    key, rest = at[0], at[1:]
    if new is DELETE and not rest:
        del copy[key]
    else:
        copy[key] = replaced(copy[key], rest, new)
    return copy


DELETE = object()


@st.composite
def body_of(draw: st.DrawFn, path: str, model: str = MODEL) -> dict[str, Any]:
    """`path`'s valid body (for `model`) with up to four top-level fields set (or
    deleted) and up to two places inside it (a message, a content part's text, ...)
    changed to any JSON."""
    body = {**BASES[path], "model": model}
    if draw(st.booleans()):  # half the cases stream (the tracked relay's path)
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": True}
    for key in draw(st.lists(st.sampled_from(sorted(PLAUSIBLE)), max_size=4)):
        action = draw(st.sampled_from(["plausible", "plausible", "any", "delete"]))
        if action == "delete":
            body.pop(key, None)
        else:
            value = draw(PLAUSIBLE[key] if action == "plausible" else JSON)
            body[key] = model if key == "model" and value == MODEL else value
    for _ in range(draw(st.integers(0, 2))):
        inside = [p for p in paths(body) if len(p) > 1]
        if inside:
            at = draw(st.sampled_from(inside))
            body = replaced(body, at, draw(st.just(DELETE) | JSON))
    return body


def cases(paths: Sequence[str] = tuple(BASES), model: str = MODEL
          ) -> st.SearchStrategy[tuple[str, bytes, dict[str, str]]]:
    """(route, body, headers) for a route of `paths`, its body written for `model`."""
    return st.sampled_from(sorted(paths)).flatmap(
        lambda path: st.tuples(st.just(path), body_of(path, model).map(dumps),
                               st.tuples(MOVES, HEADERS).map(lambda h: {**h[0], **h[1]})))


CASES = cases()
NOT_OBJECTS = st.tuples(
    st.sampled_from(sorted(BASES)),
    JSON.filter(lambda v: not isinstance(v, dict)).map(dumps)
    | st.binary(max_size=40) | st.sampled_from([
        b"", b"{", b'{"model": MODEL,}', b'{"model": NaN}', b"[" * 5000 + b"]" * 5000,
        b'{"model": MODEL, "model": 3}', b'{"model": "\xff\xfe"}', b"\x00" * 8]),
    HEADERS)


class Errors(logging.Handler):
    """Every record logged at ERROR or above while installed."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


T = TypeVar("T")


@contextlib.contextmanager
def on_a_thread(setup: Callable[[], AbstractAsyncContextManager[T]]
                ) -> Iterator[tuple[T, Errors]]:
    """Enter `setup()` (a proxy and its backends) on an event loop in a thread of its
    own, so that hypothesis's cases are plain calls to it; yield what it gives and an
    `Errors` handler on the root logger meanwhile. Exited when the block ends."""
    errors = Errors()
    logging.getLogger().addHandler(errors)
    try:
        with in_a_thread(setup) as entered:
            yield entered, errors
    finally:
        logging.getLogger().removeHandler(errors)


def check_shape(path: str, answer: httpx.Response) -> None:
    """An error in the API's shape (OpenAI's; Anthropic's on /v1/messages when the
    proxy refused it, while a backend's error is relayed as the backend wrote it: vLLM
    writes OpenAI's there too), a stream that ends with its end event (or an error
    event), a whole answer in JSON."""
    if answer.status_code >= 400:
        error = orjson.loads(answer.content)
        if path.startswith("/v1/messages") and "x-laneway-backend" not in answer.headers:
            assert error["type"] == "error", error
        error = error["error"]
        assert isinstance(error, dict), error
        assert isinstance(error["message"], str) and error["message"], error
        assert isinstance(error["type"], str), error
    elif answer.headers.get("content-type", "").startswith("text/event-stream"):
        text = answer.text
        if path in ("/v1/chat/completions", "/v1/completions"):
            assert text.rstrip().endswith("data: [DONE]"), text[-300:]
        elif path == "/v1/responses":
            assert "response.completed" in text or "error" in text, text[-300:]
        elif path == "/v1/messages":
            assert "message_stop" in text or "error" in text, text[-300:]
    else:
        orjson.loads(answer.content)


# The suite runs the same cases every time (derandomized). To look for more, run with
# LANEWAY_FUZZ_EXPLORE=N: new random cases, N times as many.
_EXPLORE = int(os.environ.get("LANEWAY_FUZZ_EXPLORE", "0"))


def fuzz(examples: int) -> settings:
    """Hypothesis's settings for a fuzz test of `examples` cases."""
    return settings(max_examples=examples * max(_EXPLORE, 1), deadline=None,
                    derandomize=not _EXPLORE, database=None,  # (no .hypothesis/ written)
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
