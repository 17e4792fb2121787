"""What one upstream stream event adds to a generation, read from vLLM's JSON.

A tracked stream (one that may migrate) is decoded event by event: the token ids of
each event (`return_token_ids`), its text, and how the generation ended. Chat and
completions events carry the same facts in different places; `Piece` hides that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson


class UpstreamEventError(Exception):
    """The backend sent an event that is not a completion chunk (e.g. an error).
    `refusal`: (status, the event's payload) when it is an error with a 4xx code, the
    backend refusing the request itself (vLLM validates some requests only after its
    stream began, e.g. a token id out of the vocabulary): any backend would refuse it."""

    def __init__(self, message: str, refusal: tuple[int, bytes] | None = None) -> None:
        super().__init__(message)
        self.refusal = refusal


@dataclass(slots=True)  # not frozen: its __init__ runs once per token, frozen costs 2x
class Piece:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    event: dict[str, Any] | None = None  # the decoded event itself
    fingerprint: str | None = None
    reasoning: str = ""  # a chat delta's reasoning text (a server with a reasoning parser)


def parse_event(payload: bytes, chat: bool) -> Piece:
    """One `data:` payload of a chat or completions stream."""
    try:
        event = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise UpstreamEventError(f"undecodable stream event: {exc}") from None
    if not isinstance(event, dict) or "error" in event:
        raise UpstreamEventError(f"stream error event: {payload[:300]!r}",
                                 _refusal(event, payload))
    choices = event.get("choices") or []
    if type(choices) is not list:
        raise _malformed(payload)
    choice = choices[0] if choices and type(choices[0]) is dict else {}
    reasoning: Any = ""
    if chat:
        delta = choice.get("delta") or {}
        if type(delta) is not dict:
            raise _malformed(payload)
        text = delta.get("content") or ""
        # vLLM 0.32 names it `reasoning`; earlier versions `reasoning_content`
        reasoning = delta.get("reasoning") or delta.get("reasoning_content") or ""
        prompt_ids = event.get("prompt_token_ids")
    else:
        text = choice.get("text") or ""
        prompt_ids = choice.get("prompt_token_ids")
    token_ids = choice.get("token_ids") or []
    # What the relay and a continuation rely on: another shape is a broken backend.
    if type(text) is not str or type(reasoning) is not str or type(token_ids) is not list \
            or (prompt_ids is not None and type(prompt_ids) is not list):
        raise _malformed(payload)
    return Piece(
        text=text,
        token_ids=token_ids,
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        prompt_token_ids=prompt_ids,
        usage=event.get("usage"),
        event=event,
        fingerprint=event.get("system_fingerprint"),
        reasoning=reasoning,
    )


def _refusal(event: Any, payload: bytes) -> tuple[int, bytes] | None:
    error = event.get("error") if isinstance(event, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return (code, payload) if type(code) is int and 400 <= code < 500 else None


def _malformed(payload: bytes) -> UpstreamEventError:
    return UpstreamEventError(f"malformed stream event: {payload[:300]!r}")
