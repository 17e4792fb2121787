"""The bytes the fake vLLM sends: SSE chunks and JSON bodies shaped like vLLM 0.32's.

Shapes follow vLLM's pydantic models serialised with `exclude_unset=True`: chat
streams open with a role-only event, every token is one event, the last token's
event carries `finish_reason` and `stop_reason`, an optional usage event has empty
`choices`, then `data: [DONE]`. Per-request templates are encoded once; a token costs
one bytes `%`-format.

Token model (deterministic, so migration can be tested): generated token `i` reads
`tok<i> ` and has id `GEN_BASE + i`. A prompt given as token ids whose last id is a
generated id continues the count, so prompt_ids + generated_ids sent to a second
fake resumes the same sequence. Text prompts get one id per word after a BOS id.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import orjson

BOS_ID = 1
GEN_BASE = 100
GEN_SPAN = 100_000
PROMPT_BASE = GEN_BASE + GEN_SPAN
PROMPT_SPAN = 100_000
DONE = b"data: [DONE]\n\n"


def prompt_token_ids(chat: bool, body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    text = _chat_text(body.get("messages")) if chat else str(prompt or "")
    return [BOS_ID, *text_token_ids(text)]


def text_token_ids(text: str) -> list[int]:
    """One id per word; a generated word `tok<i>` maps back to its generated id, so
    re-tokenized output continues the count like a real tokenizer round trip."""
    return [GEN_BASE + int(w[3:]) if w.startswith("tok") and w[3:].isdigit()
            else PROMPT_BASE + zlib.crc32(w.encode()) % PROMPT_SPAN for w in text.split()]


def first_index(prompt_ids: list[int]) -> int:
    """Index of the first token to generate: continues a sequence of generated ids."""
    last = prompt_ids[-1] if prompt_ids else 0
    return last - GEN_BASE + 1 if GEN_BASE <= last < GEN_BASE + GEN_SPAN else 0


def _chat_text(messages: Any) -> str:
    parts: list[str] = []
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [p["text"] for p in content if isinstance(p, dict) and "text" in p]
    return " ".join(parts)


@dataclass(frozen=True, slots=True)
class Completion:
    """What one request will produce."""

    chat: bool
    request_id: str
    model: str
    created: int
    prompt_ids: list[int]
    start: int  # index of the first generated token
    tokens: int
    finish_reason: str  # "length" or "stop"
    token_ids: bool  # the client asked for return_token_ids
    reasoning: int = 0  # chat: generated tokens 0..reasoning-1 are reasoning (a parser's)


class StreamWire:
    """Pre-encoded SSE events of one streamed completion."""

    __slots__ = ("_finish", "_prompt_ids", "_reasoning", "_template", "done", "job",
                 "opening")

    def __init__(self, job: Completion) -> None:
        self.job = job
        top = b'data: {"id":' + orjson.dumps(job.request_id) + b',"object":' + (
            b'"chat.completion.chunk"' if job.chat else b'"text_completion"'
        ) + b',"created":%d,"model":' % job.created + orjson.dumps(job.model) + b","
        head = top.replace(b"%", b"%%") + b'"choices":[{"index":0,'
        prompt_ids = orjson.dumps(job.prompt_ids) if job.token_ids else b"null"
        if job.chat:
            self.opening = (top + b'"choices":[{"index":0,"delta":{"role":"assistant",'
                            b'"content":""},"logprobs":null,"finish_reason":null}],'
                            b'"prompt_token_ids":' + prompt_ids + b',"prompt_text":null}\n\n')
            self._template = head + (b'"delta":{"content":"tok%d "},"logprobs":null,'
                                     b'"finish_reason":%b,"token_ids":%b}]}\n\n')
            self._reasoning = self._template.replace(b'"content"', b'"reasoning"', 1)
            self._prompt_ids = b""
        else:
            self.opening = b""
            self._template = head + (b'"text":"tok%d ","logprobs":null,"finish_reason":%b,'
                                     b'"stop_reason":null,"prompt_token_ids":%b,'
                                     b'"token_ids":%b}]}\n\n')
            self._reasoning = self._template
            self._prompt_ids = prompt_ids
        self._finish = b'"%s","stop_reason":null' % job.finish_reason.encode() if job.chat \
            else b'"%s"' % job.finish_reason.encode()
        self.done = top + b'"choices":[],"usage":' + _usage(job) + b"}\n\n" + DONE

    def token(self, offset: int) -> bytes:
        """The event of the `offset`-th generated token (0-based within this response)."""
        job = self.job
        index = job.start + offset
        finish = self._finish if offset == job.tokens - 1 else b"null"
        ids = b"[%d]" % (GEN_BASE + index) if job.token_ids else b"null"
        if job.chat:
            template = self._reasoning if index < job.reasoning else self._template
            return template % (index, finish, ids)
        prompt = (self._prompt_ids if offset == 0 else b"null")
        return self._template % (index, finish, prompt, ids)

    def closing(self, usage: bool) -> bytes:
        return self.done if usage else DONE


def _usage(job: Completion) -> bytes:
    prompt = len(job.prompt_ids)
    return orjson.dumps({"prompt_tokens": prompt, "total_tokens": prompt + job.tokens,
                         "completion_tokens": job.tokens})


def full_body(job: Completion) -> bytes:
    """The non-streamed response body."""
    split = min(max(job.reasoning, job.start), job.start + job.tokens)
    reasoning = "".join(f"tok{i} " for i in range(job.start, split))
    text = "".join(f"tok{i} " for i in range(split, job.start + job.tokens))
    token_ids = list(range(GEN_BASE + job.start, GEN_BASE + job.start + job.tokens)) \
        if job.token_ids else None
    prompt_ids = job.prompt_ids if job.token_ids else None
    choice: dict[str, Any] = {"index": 0}
    if job.chat:
        choice["message"] = {"role": "assistant", "content": text if text or not reasoning
                             else None, "refusal": None, "annotations": None, "audio": None,
                             "function_call": None, "tool_calls": [],
                             "reasoning": reasoning or None}
    else:
        choice["text"] = text
    choice |= {"logprobs": None, "finish_reason": job.finish_reason, "stop_reason": None,
               "token_ids": token_ids}
    if not job.chat:
        choice |= {"prompt_logprobs": None, "prompt_token_ids": prompt_ids}
    body: dict[str, Any] = {
        "id": job.request_id, "object": "chat.completion" if job.chat else "text_completion",
        "created": job.created, "model": job.model, "choices": [choice],
        "service_tier": None, "system_fingerprint": None,
        "usage": orjson.loads(_usage(job)) | {"prompt_tokens_details": None},
    }
    if job.chat:
        body |= {"prompt_logprobs": None, "prompt_token_ids": prompt_ids}
    return orjson.dumps(body | {"kv_transfer_params": None})
