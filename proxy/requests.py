"""Turn a request body into a validated `RequestContext`, or an `InvalidRequest`.

The proxy checks only what it reads itself (model, prompt, stream, max_tokens,
session, SLO); every other field goes to the backend untouched, in the original
bytes, so the backend stays the judge of its own parameters.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import orjson

from proxy.errors import InvalidRequest
from proxy.types import Endpoint, RequestContext

SLO_HEADER = "x-laneway-slo-ms"
_ids = itertools.count()
_ID_PREFIX = os.urandom(4).hex()
# the client's own estimate of the completion length (e.g. a batch job that knows it)
EXPECTED_TOKENS_HEADER = "x-laneway-expected-tokens"


def request_id(headers: Mapping[str, str]) -> str:
    """The client's `x-request-id`, or a new id unique to this process."""
    return headers.get("x-request-id") or f"lw-{_ID_PREFIX}-{next(_ids)}"


def parse_body(body: bytes) -> dict[str, Any]:
    if not body:
        raise InvalidRequest("Request body is empty; expected a JSON object.")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("Request body must be a JSON object.")
    return data


def build_context(
    data: dict[str, Any],
    endpoint: Endpoint,
    headers: Mapping[str, str],
    *,
    request_id: str,
    max_tokens_limit: int,
    session_header: str,
    block_chars: int,
) -> RequestContext:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("`model` is required and must be a non-empty string.", param="model")
    prompt_text = _PROMPTS[endpoint](data)
    stream = data.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest("`stream` must be a boolean.", param="stream")
    return RequestContext(
        request_id=request_id,
        endpoint=endpoint,
        model=model,
        prompt_text=prompt_text,
        prompt_blocks=prefix_blocks(prompt_text, block_chars),
        stream=bool(stream),
        max_tokens=_max_tokens(data, endpoint, max_tokens_limit),
        session=headers.get(session_header) or _optional_str(data, "user"),
        slo_ms=_slo_ms(headers),
        expected_tokens=_expected_tokens(headers),
        arrived_at=time.monotonic(),
    )


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
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(
            "`messages` is required and must be a non-empty array.", param="messages")
    parts: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(
                f"`messages[{i}]` must be an object with a string `role`.",
                param=f"messages[{i}]")
        parts.append(f"{message['role']}: {_content_text(message.get('content'), i)}")
    return "\n".join(parts)


def _content_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "".join(t for t in texts if isinstance(t, str))
    raise InvalidRequest(
        f"`messages[{index}].content` must be a string or an array of content parts.",
        param=f"messages[{index}].content")


def _completion_prompt(data: dict[str, Any]) -> str:
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if prompt is None and data.get("prompt_embeds") is not None:
        return ""  # embeddings instead of tokens (vLLM's --enable-prompt-embeds)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return " ".join(map(str, prompt))  # token ids: hashed as text for prefixes
        if all(isinstance(p, list) for p in prompt):
            return "\n".join(" ".join(map(str, p)) for p in prompt)
    raise InvalidRequest(
        "`prompt` is required: a string, an array of strings, or an array of token ids "
        "(or `prompt_embeds`).", param="prompt")


def _responses_prompt(data: dict[str, Any]) -> str:
    """The text of a Responses API request: `instructions`, then `input` (a string or
    a list of items: messages with string or part content, tool outputs, ...)."""
    instructions = _optional_str(data, "instructions")
    parts = [f"system: {instructions}"] if instructions else []
    items = data.get("input")
    if isinstance(items, str):
        parts.append(items)
    elif isinstance(items, list) and items:
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise InvalidRequest(f"`input[{i}]` must be an object.", param=f"input[{i}]")
            text = item.get("output") if "content" not in item else item["content"]
            if isinstance(text, list):
                text = "".join(p.get("text", "") for p in text
                               if isinstance(p, dict) and isinstance(p.get("text"), str))
            role = item.get("role") or item.get("type") or "item"
            parts.append(f"{role}: {text if isinstance(text, str) else ''}")
    else:
        raise InvalidRequest("`input` is required: a string or a non-empty array of "
                             "input items.", param="input")
    return "\n".join(parts)


def _messages_prompt(data: dict[str, Any]) -> str:
    """The text of an Anthropic Messages API request: `system` (a string or text
    blocks), then the messages as for chat (their content blocks carry `text`)."""
    system = data.get("system")
    if isinstance(system, list):
        system = "".join(b.get("text", "") for b in system
                         if isinstance(b, dict) and isinstance(b.get("text"), str))
    elif system is not None and not isinstance(system, str):
        raise InvalidRequest("`system` must be a string or an array of text blocks.",
                             param="system")
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


def _max_tokens(data: dict[str, Any], endpoint: Endpoint, limit: int) -> int | None:
    """The generation's length bound as the backend will apply it, checked (None: up
    to the model's context). A field the backend ignores is left to the backend."""
    key = next((k for k in _LENGTH_KEYS[endpoint] if data.get(k) is not None), None)
    if key is None:
        return _COMPLETIONS_MAX_TOKENS if endpoint == "completions" else None
    value = data[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"`{key}` must be an integer.", param=key)
    # 0 is legal on /v1/completions (echo + prompt logprobs); never elsewhere.
    lowest = 0 if endpoint == "completions" else 1
    if value < lowest:
        raise InvalidRequest(f"`{key}` must be at least {lowest}, got {value}.", param=key)
    if value > limit:
        raise InvalidRequest(
            f"`{key}` is {value}, above this server's limit of {limit}.", param=key)
    return value


def _optional_str(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"`{key}` must be a string.", param=key)
    return value


N = TypeVar("N", int, float)


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
