"""Cheap accounting of a relayed SSE stream, without decoding its JSON.

One vLLM stream event is one `data: ` line and, for n=1, carries one token; the
usage numbers are read from the tail when the client asked for them. A Responses API
stream (`/v1/responses`) and an Anthropic Messages stream (`/v1/messages`) have no
`[DONE]`: they end with a terminal event (`StreamEnd`), looked for in every chunk
since `response.completed` carries the whole response and can be longer than the tail.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from proxy.errors import (
    ProxyError,
    anthropic_error_event,
    responses_error_event,
    stream_error_event,
)

_EVENT = b"data: "
_DONE = b"data: [DONE]"
_TAIL_BYTES = 1024  # holds the usage event + [DONE] however the chunks split them
_RECENT_CHUNKS = 16


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """How a stream without `[DONE]` ends, and how it reports a failure."""

    markers: tuple[bytes, ...]  # any of these in the stream: it ended as it should
    error_event: Callable[[ProxyError], bytes]


RESPONSES_END = StreamEnd((b"event: response.completed", b"event: response.incomplete",
                           b"event: response.failed"), responses_error_event)
MESSAGES_END = StreamEnd((b"event: message_stop",), anthropic_error_event)
# as long as the longest marker: one split across two chunks is still seen
_CARRY = max(len(m) for end in (RESPONSES_END, MESSAGES_END) for m in end.markers)


class StreamTally:
    __slots__ = ("_ended", "_ends", "events", "failed", "first_at", "last_at", "recent")

    def __init__(self, first_at: float, ends: StreamEnd | None = None) -> None:
        """A tally of what the relay sent of a stream whose first bytes came at
        `first_at`. `ends`: how the stream ends (`RESPONSES_END`, `MESSAGES_END`);
        None: `[DONE]`."""
        self.first_at = first_at
        self.last_at = first_at
        self.events = 0
        # The last chunks, joined only when the stream ends (usage, [DONE]).
        self.recent: deque[bytes] = deque((b"",), maxlen=_RECENT_CHUNKS)
        self.failed = False
        self._ends = ends
        self._ended = False

    def add(self, chunk: bytes, now: float) -> None:
        self.events += chunk.count(_EVENT)
        if self._ends is not None and not self._ended:
            self._ended = _has_any(self.recent[-1][-_CARRY:] + chunk, self._ends.markers)
        self.recent.append(chunk)
        self.last_at = now

    def last_seen(self) -> float:
        return self.last_at

    @property
    def tail(self) -> bytes:
        return b"".join(self.recent)[-_TAIL_BYTES:]

    @property
    def saw_done(self) -> bool:
        """Whether the stream ended as it should (`[DONE]`, or a terminal event)."""
        if self._ends is not None:
            return self._ended
        return self.tail.rstrip().endswith(_DONE)

    def is_end_event(self, event: bytes) -> bool:
        """Whether `event` (one event, without the blank line that would end it) is
        this stream's last: `data: [DONE]`, or a terminal event whose data is whole
        JSON (not one cut off inside its data)."""
        if self._ends is None:
            return event.rstrip() == _DONE
        if not _has_any(event, self._ends.markers):
            return False
        data = [line[5:] for line in event.splitlines() if line.startswith(b"data:")]
        try:
            orjson.loads(b"\n".join(data))
        except orjson.JSONDecodeError:
            return False
        return True

    def usage(self, chat: bool) -> tuple[int | None, int]:
        """(prompt_tokens, completion_tokens): exact if usage was streamed, else estimated."""
        tail = self.tail
        prompt = _int_after(tail, b'"prompt_tokens":')
        completion = _int_after(tail, b'"completion_tokens":')
        if completion is None:  # the Responses and Messages APIs' names
            prompt = _int_after(tail, b'"input_tokens":')
            completion = _int_after(tail, b'"output_tokens":')
        if completion is not None:
            return prompt, completion
        # vLLM sends one event per token (the last one carries finish_reason), plus
        # [DONE], plus on chat a leading role-only event.
        return prompt, max(0, self.events - 1 - chat)

    def tpot(self, tokens: int) -> float | None:
        if tokens < 2:
            return None
        return (self.last_at - self.first_at) / (tokens - 1)

    def error_event(self, err: ProxyError) -> bytes:
        """The stream's error event (the relay sends whole events only: it follows one)."""
        return stream_error_event(err) if self._ends is None else self._ends.error_event(err)


def body_usage(body: bytes) -> tuple[int | None, int]:
    """(prompt_tokens, completion_tokens) of a non-streamed response body."""
    try:
        usage = orjson.loads(body).get("usage") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return None, 0
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))  # OpenAI, Responses/Anthropic
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    return (
        prompt if isinstance(prompt, int) else None,
        completion if isinstance(completion, int) else 0,
    )


def _has_any(buf: bytes, markers: tuple[bytes, ...]) -> bool:
    return any(marker in buf for marker in markers)


def _int_after(buf: bytes, key: bytes) -> int | None:
    at = buf.rfind(key)
    if at < 0:
        return None
    start = at + len(key)
    while start < len(buf) and buf[start : start + 1] == b" ":
        start += 1
    end = start
    while end < len(buf) and buf[end : end + 1].isdigit():
        end += 1
    return int(buf[start:end]) if end > start else None
