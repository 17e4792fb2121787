"""Client-side bytes of a tracked generation, in the format the client asked for.

A tracked stream may be spliced from several backends (and from both endpoints: a
migrated chat continues on `/v1/completions`), so the proxy writes every event
itself, shaped like vLLM 0.32's own (pydantic models serialised as vLLM does): the
`id`, `created` and `model` of the first backend's response, chat chunks for chat.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """What every event of one response repeats."""

    id: str
    created: int
    model: str
    chat: bool
    with_token_ids: bool  # the client asked for `return_token_ids`
    prompt_text: str | None = None  # the templated prompt (chat's `return_prompt_text`)
    # A plain token event's bytes around its JSON-encoded text (`token_event`'s fast
    # path: most events of a stream differ only by their text).
    _around_text: tuple[bytes, bytes] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        marker = orjson.dumps("\x00laneway-text\x00")
        whole = _plain_event(self, orjson.loads(marker))
        before, _, after = whole.partition(marker)
        around = (before, after) if whole.count(marker) == 1 else None  # (an odd id)
        object.__setattr__(self, "_around_text", around)

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def pass_event(event: dict[str, Any], head: ResponseHead) -> bytes:
    """A backend's own event (e.g. the chat role event), token ids hidden if not asked."""
    if not head.with_token_ids and event.get("prompt_token_ids") is not None:
        event["prompt_token_ids"] = None
    return _event(event)


def token_event(
    head: ResponseHead, text: str, token_ids: list[int], *,
    finish_reason: str | None = None, stop_reason: str | int | None = None,
    prompt_token_ids: list[int] | None = None, fingerprint: str | None = None,
    reasoning: str = "", usage: tuple[int, int] | None = None,
) -> bytes:
    """`usage`: (prompt, completion) tokens so far, for a server that puts usage in
    every chunk (`--enable-force-include-usage`)."""
    around = head._around_text
    if around is not None and finish_reason is None and fingerprint is None \
            and not head.with_token_ids and not reasoning and usage is None:
        return around[0] + orjson.dumps(text) + around[1]  # the rest is as the last's
    return _token_event(head, text, token_ids, finish_reason, stop_reason,
                        prompt_token_ids, fingerprint, reasoning, usage)


def _plain_event(head: ResponseHead, text: str) -> bytes:
    """A token event without finish, fingerprint or token ids."""
    return _token_event(head, text, [], None, None, None, None, "", None)


def _token_event(
    head: ResponseHead, text: str, token_ids: list[int], finish_reason: str | None,
    stop_reason: str | int | None, prompt_token_ids: list[int] | None,
    fingerprint: str | None, reasoning: str, usage: tuple[int, int] | None,
) -> bytes:
    ids = token_ids if head.with_token_ids else None
    choice: dict[str, Any] = {"index": 0}
    if head.chat:
        # as vLLM's delta: a reasoning-only one has no content
        delta: dict[str, str] = {"content": text} if text or not reasoning else {}
        if reasoning:
            delta["reasoning"] = reasoning
        choice |= {"delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        choice["token_ids"] = ids
    else:
        choice |= {"text": text, "logprobs": None, "finish_reason": finish_reason,
                   "stop_reason": stop_reason,
                   "prompt_token_ids": prompt_token_ids if head.with_token_ids else None,
                   "token_ids": ids}
    data = {"id": head.id, "object": head.chunk_object, "created": head.created,
            "model": head.model, "choices": [choice]}
    if fingerprint is not None:
        data["system_fingerprint"] = fingerprint
    if usage is not None:  # as vLLM: a chat chunk's has one more (empty) field
        data["usage"] = usage_json(*usage) | (
            {"completion_tokens_details": None} if head.chat else {})
    return _event(data)


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


def usage_event(
    head: ResponseHead, prompt_tokens: int, completion_tokens: int, fingerprint: str | None
) -> bytes:
    data: dict[str, Any] = {
        "id": head.id, "object": head.chunk_object, "created": head.created,
        "model": head.model, "choices": [],
        "usage": usage_json(prompt_tokens, completion_tokens)}
    if fingerprint is not None:
        data["system_fingerprint"] = fingerprint
    return _event(data)


def comment_event(data: dict[str, Any]) -> bytes:
    """An SSE comment (`: laneway {...}`): clients that follow SSE ignore it."""
    return b": laneway " + orjson.dumps(data) + b"\n\n"


def completion_body(
    head: ResponseHead, text: str, token_ids: list[int], prompt_token_ids: list[int] | None,
    finish_reason: str | None, stop_reason: str | int | None, fingerprint: str | None,
    reasoning: str | None = None,
) -> dict[str, Any]:
    """A whole non-streamed response, as vLLM 0.32 shapes it (with a reasoning parser,
    `content` is null when all of the answer was reasoning)."""
    prompt_ids = prompt_token_ids if head.with_token_ids else None
    choice: dict[str, Any] = {"index": 0}
    if head.chat:
        choice["message"] = {"role": "assistant",
                             "content": text if text or reasoning is None else None,
                             "refusal": None, "annotations": None, "audio": None,
                             "function_call": None, "reasoning": reasoning}
    else:
        choice["text"] = text
    choice |= {"logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason,
               "token_ids": token_ids if head.with_token_ids else None}
    if not head.chat:
        choice |= {"prompt_logprobs": None, "prompt_token_ids": prompt_ids}
    prompt_tokens = len(prompt_token_ids or ())
    body: dict[str, Any] = {
        "id": head.id, "object": "chat.completion" if head.chat else "text_completion",
        "created": head.created, "model": head.model, "choices": [choice | {
            "routed_experts": None}],
        "service_tier": None, "system_fingerprint": fingerprint,
        "usage": usage_json(prompt_tokens, len(token_ids)) | {
            "prompt_tokens_details": None, "completion_tokens_details": None},
    }
    if head.chat:
        body |= {"prompt_logprobs": None, "prompt_token_ids": prompt_ids,
                 "prompt_text": head.prompt_text}
    return body | {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
