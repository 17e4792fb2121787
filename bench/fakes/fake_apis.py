"""The fake vLLM's other generation APIs.

The Responses API (`/v1/responses`), as vLLM 0.32 serves it with
`VLLM_ENABLE_RESPONSES_API_STORE=1`: whole or streamed (`response.created`, one
`response.output_text.delta` per token, `response.completed` with `usage`, no
`[DONE]`); every response is stored, readable and cancellable by id on this server
only, and `previous_response_id` must name one stored here.

The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`): whole or
streamed (`message_start`, one `content_block_delta` per token, `message_delta` with
the output usage, `message_stop`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson

from bench.fakes.fake_wire import text_token_ids
from proxy.asgi import Receive, Scope, Send, send_json

if TYPE_CHECKING:
    from bench.fakes.fake_vllm import FakeVllm

PREFIX = "/v1/responses"
MESSAGES = "/v1/messages"


async def handle(fake: FakeVllm, scope: Scope, receive: Receive, send: Send) -> None:
    path: str = scope["path"]
    if path == PREFIX:
        await _create(fake, receive, send)
        return
    response_id, _, action = path[len(PREFIX) + 1:].partition("/")
    stored = fake.responses.get(response_id)
    if stored is None:
        await _not_found(send, response_id)
    elif action == "cancel":
        await send_json(send, 200, stored | {"status": "cancelled"})
    elif b"stream=true" in scope["query_string"]:  # replayed as the events it streamed
        tokens = stored["usage"]["output_tokens"]
        await fake.cancellable(receive, lambda: _stream(fake, stored, tokens, send))
    else:  # echoes the query it got (`include=…`), for the proxy's tests
        query = scope["query_string"].decode()
        await send_json(send, 200, stored | ({"query": query} if query else {}))


async def _not_found(send: Send, response_id: str) -> None:
    await send_json(send, 404, {"error": {
        "message": f"Response with id '{response_id}' not found.",
        "type": "invalid_request_error", "param": "response_id", "code": 404}})


async def _create(fake: FakeVllm, receive: Receive, send: Send) -> None:
    if (taken := await fake.take(receive, send)) is None:
        return
    body, model = taken
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):  # vLLM's pydantic check
        await send_json(send, 400, {"error": {
            "message": "previous_response_id: Input should be a valid string",
            "type": "BadRequestError", "param": None, "code": 400}})
        return
    if previous is not None and previous not in fake.responses:
        await _not_found(send, str(previous))
        return
    prompt = len(text_token_ids(str(body.get("input", ""))))
    tokens = int(body.get("max_output_tokens") or fake.config.default_tokens)
    response_id = f"resp_{id(fake):x}_{len(fake.responses)}"  # unique across fakes
    text = "".join(f"tok{i} " for i in range(tokens))
    done = {"id": response_id, "object": "response", "created_at": fake.created,
            "model": model, "status": "completed", "previous_response_id": previous,
            "output": [{"type": "message", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": text}]}],
            "usage": {"input_tokens": prompt, "output_tokens": tokens,
                      "total_tokens": prompt + tokens}}
    fake.responses[response_id] = done
    if body.get("stream"):
        await fake.cancellable(receive, lambda: _stream(fake, done, tokens, send))
    else:
        await fake.cancellable(receive, lambda: _whole(fake, done, send))


async def _whole(fake: FakeVllm, done: dict[str, Any], send: Send) -> None:
    await asyncio.sleep(fake.config.ttft_s + fake.config.tpot_s * done["usage"]["output_tokens"])
    await send_json(send, 200, done)
    fake.stats.finished += 1


async def _stream(fake: FakeVllm, done: dict[str, Any], tokens: int, send: Send) -> None:
    cfg = fake.config
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    created = done | {"status": "in_progress", "output": [], "usage": None}
    await _event(send, "response.created", {"response": created})
    await asyncio.sleep(cfg.ttft_s)
    for i in range(tokens):
        if await fake.cut_at(i, send):
            return
        await _event(send, "response.output_text.delta", {"delta": f"tok{i} "})
        await asyncio.sleep(cfg.tpot_s)
    await _event(send, "response.completed", {"response": done})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    fake.stats.finished += 1


async def messages(fake: FakeVllm, scope: Scope, receive: Receive, send: Send) -> None:
    if (taken := await fake.take(receive, send)) is None:
        return
    body, model = taken
    listed = body.get("messages")
    if not isinstance(listed, list):
        await send_json(send, 400, {"type": "error", "error": {
            "type": "invalid_request_error", "message": "messages: must be a list"}})
        return
    prompt = 1 + len(text_token_ids(" ".join(
        str(m.get("content", "")) for m in listed if isinstance(m, dict))))
    if scope["path"].endswith("/count_tokens"):
        await send_json(send, 200, {"input_tokens": prompt})
        return
    tokens = int(body.get("max_tokens") or fake.config.default_tokens)
    text = "".join(f"tok{i} " for i in range(tokens))
    message = {"id": f"msg_{len(fake.stats.bodies)}", "type": "message", "role": "assistant",
               "model": model, "content": [{"type": "text", "text": text}],
               "stop_reason": "max_tokens", "stop_sequence": None,
               "usage": {"input_tokens": prompt, "output_tokens": tokens}}
    if body.get("stream"):
        await fake.cancellable(receive, lambda: _message_stream(fake, message, tokens, send))
    else:
        await fake.cancellable(receive, lambda: _whole(fake, message, send))


async def _message_stream(fake: FakeVllm, message: dict[str, Any], tokens: int, send: Send
                          ) -> None:
    cfg = fake.config
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    opening = message | {"content": [], "stop_reason": None,
                         "usage": {"input_tokens": message["usage"]["input_tokens"],
                                   "output_tokens": 0}}
    await _event(send, "message_start", {"message": opening})
    await _event(send, "content_block_start",
                 {"index": 0, "content_block": {"type": "text", "text": ""}})
    await asyncio.sleep(cfg.ttft_s)
    for i in range(tokens):
        if await fake.cut_at(i, send):
            return
        await _event(send, "content_block_delta",
                     {"index": 0, "delta": {"type": "text_delta", "text": f"tok{i} "}})
        await asyncio.sleep(cfg.tpot_s)
    await _event(send, "content_block_stop", {"index": 0})
    await _event(send, "message_delta", {"delta": {"stop_reason": "max_tokens"},
                                         "usage": {"output_tokens": tokens}})
    await _event(send, "message_stop", {})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    fake.stats.finished += 1


async def _event(send: Send, kind: str, data: dict[str, Any]) -> None:
    payload = orjson.dumps(data | {"type": kind})
    await send({"type": "http.response.body", "more_body": True,
                "body": b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"})
