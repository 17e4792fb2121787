"""Turn a request body into a validated `RequestContext`, or an `InvalidRequest`.

The proxy checks only what it acts on itself (model, stream, max_tokens, its own
headers). The prompt (messages, prompt, input, instructions, system) and the `user`
field it reads for prefix hashing, predictions and sessions only as far as they are
readable; every other field goes to the backend untouched, in the original bytes, so
the backend stays the judge of its own parameters (and of a prompt the proxy could not
read). What it reads it reads as vLLM does (pydantic's lax mode: `"max_tokens": "8"`
is 8, `"stream": "true"` a stream), and a body whose fields it read in another
spelling goes upstream with them written as read (`normalized`), so that the proxy and
the backend agree on them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import orjson
from pydantic import TypeAdapter, ValidationError

from proxy.errors import InvalidRequest
from proxy.types import Endpoint, RequestContext

SLO_HEADER = "x-laneway-slo-ms"
_ids = itertools.count()
_ID_PREFIX = os.urandom(4).hex()
# the client's own estimate of the completion length (e.g. a batch job that knows it)
EXPECTED_TOKENS_HEADER = "x-laneway-expected-tokens"
# a cost-aware policy's per-request budget and the reader's pace (DiSCo: docs/disco.md)
BUDGET_HEADER = "x-laneway-budget"
READ_RATE_HEADER = "x-laneway-read-rate"
_MAX_READ_RATE = 1000.0  # tokens/s (as the disco policy's `read_rate` param)
# The context's fields the four headers above set: a client's own with `auth` off, a
# key's only when it is allowed hints (they buy a tighter SLO or a larger cost budget).
_HINTS = ("slo_ms", "expected_tokens", "budget", "read_rate")


# A client's `x-request-id` is echoed and logged only if it is this short and plain;
# any other is replaced by a new id (docs/security_limits.md).
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
# Body fields that only laneway may set: vLLM's per-request scheduling priority (flow
# control orders requests by the key's priority), the disaggregated-prefill handle
# (proxy/routing/kv_transfer.py sets its own), and laneway's own `vllm_xargs`.
_LANEWAY_ONLY = ("priority", "kv_transfer_params")
_LANEWAY_XARGS = "laneway_"
# JSON strings (skipped when counting brackets), and every byte but a bracket
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def new_request_id() -> str:
    """An id unique to this process: the key policies keep a request's state under."""
    return f"lw-{_ID_PREFIX}-{next(_ids)}"


def plain_request_id(sent: str) -> bool:
    """Whether a client's `x-request-id` is short and plain enough to echo and log."""
    return _CLIENT_ID.fullmatch(sent) is not None


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The client's `x-request-id` if it is short and plain (else None: not echoed)."""
    sent = headers.get("x-request-id")
    return sent if sent is not None and plain_request_id(sent) else None


def request_id(headers: Mapping[str, str]) -> str:
    """The id a client sees (`x-request-id`): its own if short and plain, else new."""
    return client_request_id(headers) or new_request_id()


def parse_body(body: bytes, max_depth: int = 64) -> dict[str, Any]:
    """The JSON object `body` holds, nested at most `max_depth` deep (a deeper one is
    refused here: orjson reads up to 1024 levels but writes only 254)."""
    if not body:
        raise InvalidRequest("Request body is empty; expected a JSON object.")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("Request body must be a JSON object.")
    if not _depth_within(body, max_depth):
        raise InvalidRequest(f"Request body nests JSON arrays and objects deeper than "
                             f"{max_depth} levels (server.max_json_depth).")
    return data


def _depth_within(body: bytes, limit: int) -> bool:
    """Whether the (valid) JSON `body` nests at most `limit` deep. Fewer brackets than
    that cannot nest deeper (the common case, two C-speed counts); otherwise the
    brackets outside strings are walked."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return True
    depth = 0
    for byte in _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKET):
        depth += 1 if byte in b"[{" else -1
        if depth > limit:
            return False
    return True


def without_client_controls(data: dict[str, Any]) -> dict[str, Any]:
    """`data` without the fields only laneway may set (`priority`,
    `kv_transfer_params`, `vllm_xargs` keys starting with `laneway_`); `data` itself
    when it has none."""
    dropped = [key for key in _LANEWAY_ONLY if key in data]
    xargs = data.get("vllm_xargs")
    if isinstance(xargs, dict) and any(str(k).startswith(_LANEWAY_XARGS) for k in xargs):
        kept = {k: v for k, v in xargs.items() if not str(k).startswith(_LANEWAY_XARGS)}
        return {k: v for k, v in data.items() if k not in dropped} | {"vllm_xargs": kept}
    return {k: v for k, v in data.items() if k not in dropped} if dropped else data


def form_xargs_without_controls(value: bytes) -> str | None:
    """A form upload's `vllm_xargs` field (a JSON string, which vLLM's audio routes read
    with `json.loads`) without its `laneway_` keys; None when it has none (or is no JSON
    object: vLLM refuses that itself). Read as vLLM reads it, escapes included."""
    try:
        xargs = json.loads(value.decode("utf-8", errors="replace"))
    except ValueError:
        return None
    if not isinstance(xargs, dict) or not any(str(k).startswith(_LANEWAY_XARGS)
                                              for k in xargs):
        return None
    return json.dumps({k: v for k, v in xargs.items()
                       if not str(k).startswith(_LANEWAY_XARGS)})


def build_context(
    data: dict[str, Any],
    endpoint: Endpoint,
    headers: Mapping[str, str],
    *,
    request_id: str,
    max_tokens_limit: int,
    client_id: str | None = None,
    session_header: str,
    block_chars: int,
    default_model: str | None = None,
) -> RequestContext:
    """`data`'s context; `default_model`: the model of a request that names none (not
    for the Messages API, where Anthropic's and vLLM's schemas require one);
    `request_id`: the unique id policies key it by, `client_id`: the client's own
    (`client_request_id`), echoed instead if set."""
    model = named_model(data, None if endpoint == "messages" else default_model)
    prompt_text = _PROMPTS[endpoint](data)
    stream = data.get("stream")
    if stream is not None:
        stream = lax_bool(stream)
        if stream is None:
            raise InvalidRequest("`stream` must be a boolean.", param="stream")
    return RequestContext(
        request_id=request_id,
        client_id=client_id,
        endpoint=endpoint,
        model=model,
        prompt_text=prompt_text,
        prompt_blocks=prefix_blocks(prompt_text, block_chars),
        stream=bool(stream),
        max_tokens=_max_tokens(data, endpoint, max_tokens_limit),
        session=headers.get(session_header) or _session_of(data),
        slo_ms=_slo_ms(headers),
        expected_tokens=_expected_tokens(headers),
        arrived_at=time.monotonic(),
        budget=_bounded_header(headers, BUDGET_HEADER, 1.0, "a number from 0 to 1"),
        read_rate=_bounded_header(headers, READ_RATE_HEADER, _MAX_READ_RATE,
                                  f"a number of tokens/s from 0 to {_MAX_READ_RATE:g}"),
    )


def without_hints(ctx: RequestContext) -> RequestContext:
    """`ctx` with no routing hints (`x-laneway-slo-ms`, `-expected-tokens`, `-budget`,
    `-read-rate`): what a request admitted under a key without `hints` routes on."""
    if all(getattr(ctx, name) is None for name in _HINTS):
        return ctx
    return dataclasses.replace(ctx, slo_ms=None, expected_tokens=None, budget=None,
                               read_rate=None)


def choices_of(data: Mapping[str, Any]) -> int:
    """How many completions the request generates (`n`, `best_of`: vLLM generates
    `best_of` and returns `n`), as the key is charged for them; 1 if unreadable."""
    counts = [lax_int(data.get(k)) for k in ("n", "best_of") if data.get(k) is not None]
    return max([c for c in counts if c is not None and c > 0], default=1)


def normalized(data: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
    """`data` with the fields the proxy read written as it read them (the default model
    of a body that names none, `stream` and the length bound in vLLM's lax spellings);
    `data` itself when they are written so already."""
    changes: dict[str, Any] = {}
    if data.get("model") != ctx.model:
        changes["model"] = ctx.model
    stream = data.get("stream")
    if stream is not None and stream is not ctx.stream:
        changes["stream"] = ctx.stream
    key = _length_key(data, ctx.endpoint)
    if key is not None and type(data[key]) is not int:
        changes[key] = ctx.max_tokens
    return data | changes if changes else data


def named_model(data: Mapping[str, Any], default: str | None, where: str = "") -> str:
    """The model `data` names, or `default` when it names none (`model` absent, null or
    "": vLLM then serves its one model); a 400 without either."""
    model = data.get("model")
    if (model is None or model == "") and default is not None:
        return default
    if not isinstance(model, str) or not model:
        raise InvalidRequest(
            f"`model` is required{where} and must be a non-empty string: it decides "
            "which backends may answer (this proxy names no model for a request that "
            "names none: its fleet serves more than one, and `server.default_model` is "
            "not set).", param="model")
    return model


def prefix_blocks(text: str, block_chars: int) -> tuple[bytes, ...]:
    """Cumulative digests: blocks[i] identifies the first (i+1)*block_chars characters.

    A stable hash (not Python's per-process `hash`) so replicas agree on block ids.
    """
    hasher = hashlib.blake2b(digest_size=8)
    blocks = []
    for start in range(0, len(text) - block_chars + 1, block_chars):
        hasher.update(text[start : start + block_chars].encode())
        blocks.append(hasher.digest())
    return tuple(blocks)


def _chat_prompt(data: dict[str, Any]) -> str:
    """The text of the messages (`role: content`, a line each). Messages of another
    shape, or none, have no text here: the backend judges them (vLLM refuses a message
    without a role, takes content `{}`, and on the Messages API `[]` after a system)."""
    messages = data.get("messages")
    parts: list[str] = []
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, dict):
            parts.append(f"{message.get('role')}: {_content_text(message.get('content'))}")
    return "\n".join(parts)


def _content_text(content: Any) -> str:
    """A message's (a Responses item's, a system prompt's) text: its string, or its
    parts' texts; of any other content, none."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "".join(t for t in texts if isinstance(t, str))
    return ""


def _completion_prompt(data: dict[str, Any]) -> str:
    """The prompt's text: a string, strings (a line each), token ids (hashed as text for
    prefixes), lists of token ids. Any other prompt, or none (`prompt_embeds`), has no
    text here: the backend judges it."""
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return " ".join(map(str, prompt))
        if all(isinstance(p, list) for p in prompt):
            return "\n".join(" ".join(map(str, p)) for p in prompt)
    return ""


def _responses_prompt(data: dict[str, Any]) -> str:
    """The text of a Responses API request: `instructions`, then `input` (a string or
    a list of items: messages with string or part content, tool outputs, ...). An
    `input` of another shape, or none, has no text here: the backend judges it (vLLM
    takes `[]` and `{}` after instructions, refuses a number or no input)."""
    instructions = data.get("instructions")
    parts = [f"system: {instructions}"] if isinstance(instructions, str) and instructions \
        else []
    items = data.get("input")
    if isinstance(items, str):
        parts.append(items)
    elif isinstance(items, list):
        for item in items:
            if not isinstance(item, dict):
                continue
            text = _content_text(item.get("output") if "content" not in item
                                 else item["content"])
            role = item.get("role") or item.get("type") or "item"
            parts.append(f"{role}: {text}")
    return "\n".join(parts)


def _messages_prompt(data: dict[str, Any]) -> str:
    """The text of an Anthropic Messages API request: `system` (a string or text
    blocks), then the messages as for chat (their content blocks carry `text`)."""
    system = _content_text(data.get("system"))
    messages = _chat_prompt(data)
    return f"system: {system}\n{messages}" if system else messages


_PROMPTS: dict[Endpoint, Callable[[dict[str, Any]], str]] = {
    "chat": _chat_prompt, "completions": _completion_prompt, "responses": _responses_prompt,
    "messages": _messages_prompt}
# The fields that bound the generation, as vLLM reads them: the first one set wins
# (chat: `max_completion_tokens` over the deprecated `max_tokens`); vLLM's completions
# ignore `max_completion_tokens`, so the proxy does too.
_LENGTH_KEYS: dict[Endpoint, tuple[str, ...]] = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "responses": ("max_output_tokens",),
    "messages": ("max_tokens",)}
# vLLM's `/v1/completions` generates 16 tokens when `max_tokens` is absent or null.
_COMPLETIONS_MAX_TOKENS = 16


def _length_key(data: Mapping[str, Any], endpoint: Endpoint) -> str | None:
    """The field that bounds the generation, of those set, as vLLM picks it."""
    return next((k for k in _LENGTH_KEYS[endpoint] if data.get(k) is not None), None)


def _max_tokens(data: dict[str, Any], endpoint: Endpoint, limit: int) -> int | None:
    """The generation's length bound as the backend will apply it, checked (None: up
    to the model's context). A field the backend ignores is left to the backend."""
    key = _length_key(data, endpoint)
    if key is None:
        return _COMPLETIONS_MAX_TOKENS if endpoint == "completions" else None
    value = lax_int(data[key])
    if value is None:
        raise InvalidRequest(f"`{key}` must be an integer.", param=key)
    # 0 is legal on /v1/completions (echo + prompt logprobs); never elsewhere.
    lowest = 0 if endpoint == "completions" else 1
    if value < lowest:
        raise InvalidRequest(f"`{key}` must be at least {lowest}, got {value}.", param=key)
    if value > limit:
        raise InvalidRequest(
            f"`{key}` is {value}, above this server's limit of {limit}.", param=key)
    return value


def _session_of(data: dict[str, Any]) -> str | None:
    """The OpenAI `user` field, as a session: a string; any other value is the
    backend's to judge (vLLM refuses it on chat, ignores it on the Messages API)."""
    user = data.get("user")
    return user if isinstance(user, str) and user else None


N = TypeVar("N", int, float)
T = TypeVar("T")
# vLLM's request models read these types in pydantic's lax mode; so does the proxy
_INT: TypeAdapter[int] = TypeAdapter(int)
_BOOL: TypeAdapter[bool] = TypeAdapter(bool)
_FLOAT: TypeAdapter[float] = TypeAdapter(float)


def _lax(adapter: TypeAdapter[T], value: Any) -> T | None:
    """`value` read as pydantic reads it for vLLM (`"8"` and `8.0` are 8, `"true"` and
    1 are True), or None if it cannot be."""
    try:
        return adapter.validate_python(value)
    except ValidationError:
        return None


def lax_int(value: Any) -> int | None:
    return _lax(_INT, value)


def lax_bool(value: Any) -> bool | None:
    return _lax(_BOOL, value)


def lax_float(value: Any) -> float | None:
    return _lax(_FLOAT, value)


def _slo_ms(headers: Mapping[str, str]) -> float | None:
    return _positive_header(headers, SLO_HEADER, float, "a positive number of ms")


def _expected_tokens(headers: Mapping[str, str]) -> int | None:
    return _positive_header(headers, EXPECTED_TOKENS_HEADER, int,
                            "a positive integer number of tokens")


def _positive_header(headers: Mapping[str, str], name: str, parse: Callable[[str], N],
                     what: str) -> N | None:
    """The header's value parsed, if sent; a finite number above 0 or a 400."""
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = parse(raw)
    except ValueError:
        value = None
    if value is None or not value > 0 or value == float("inf"):
        raise InvalidRequest(f"Header `{name}` must be {what}.")
    return value


def _bounded_header(headers: Mapping[str, str], name: str, highest: float, what: str
                    ) -> float | None:
    """The header's value, if sent: a number in [0, `highest`] or a 400."""
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= highest:  # (NaN fails both)
        raise InvalidRequest(f"Header `{name}` must be {what}, got {raw[:40]!r}.")
    return value
