"""A fast fake of a vLLM 0.32 OpenAI server, for unit tests and the overhead benchmark.

Pure ASGI on uvicorn (uvloop + httptools). After `ttft_s` the tokens `tok<i> ` come
every `tpot_s` on an absolute schedule (no drift); bytes are shaped like vLLM's and
pre-encoded (`bench.fakes.fake_wire`), so the fake is never the bottleneck. Failures can be
injected: an error status, a connection cut mid-stream, a request that never answers.
A client that disconnects cancels its request at once, as in vLLM, and `/metrics`
(`bench.fakes.fake_metrics`) counts what really runs here. Besides chat and completions it
serves `/tokenize`, `/v1/embeddings` (8 floats fixed by each input), and the Responses
and Anthropic Messages APIs (`bench.fakes.fake_apis`), with the same injected failures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import email.parser
import email.policy
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import uvicorn

from bench.fakes import fake_apis
from bench.fakes.fake_metrics import FakeStats, PrefixCache, render, requested_names
from bench.fakes.fake_wire import (
    BOS_ID,
    Completion,
    StreamWire,
    first_index,
    full_body,
    prompt_token_ids,
    text_token_ids,
)
from proxy.asgi import (
    ClientGone,
    Message,
    Receive,
    Scope,
    Send,
    read_body,
    send_bytes,
    send_json,
)
from proxy.http.server import uvicorn_in_loop
from proxy.migration.client_emit import usage_json

_COMPLETIONS_MAX_TOKENS = 16  # vLLM's default max_tokens on /v1/completions
REFUSAL = orjson.dumps({"error": {"message": "Token id 999999 is out of vocabulary",
                                  "type": "BadRequestError", "param": None, "code": 400}})

_JSON = [(b"content-type", b"application/json")]
_MAX_BODY = 1 << 30
_GUARDED = ("/v1", "/v2", "/inference", "/cohere")  # what vLLM's --api-key guards
_AUDIO_ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations")
_LORA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


@dataclass(frozen=True, slots=True)
class FakeConfig:
    model: str = "fake"
    aliases: tuple[str, ...] = ()  # more served model names (vLLM's --served-model-name)
    ttft_s: float = 0.0
    tpot_s: float = 0.0  # 0: unpaced (still yields to the loop between tokens)
    default_tokens: int = 16  # a chat answer's length without max_tokens (EOS)
    eos_after: int | None = None  # the "model" ends by itself after this many tokens
    max_num_seqs: int = 1024  # more concurrent requests wait (num_requests_waiting)
    kv_capacity_tokens: int = 65_536  # kv_cache_usage_perc = tokens held / this
    max_model_len: int = 4096  # as /v1/models reports it
    fail_status: int | None = None  # answer every completion request with this status
    fail_first: int | None = None  # ... or only the first N of them
    die_after_tokens: int | None = None  # cut the connection after N tokens
    garble_after_tokens: int | None = None  # ... after a malformed event, after N tokens
    refuse_after_tokens: int | None = None  # end with vLLM's 400 error event and [DONE]
    # after N tokens (as for a token id out of its vocabulary, found once streaming)
    end_after_tokens: int | None = None  # end the stream cleanly after N tokens, but
    # without its end event ([DONE], response.completed, message_stop): a broken answer
    hang: bool = False  # never answer a completion request
    api_key: str | None = None  # vLLM's --api-key: /v1/* without `Bearer <key>` is a 401
    lora_runtime: bool = False  # /v1/load_lora_adapter, /v1/unload_lora_adapter (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=1): adapters are served names, no weights change
    reasoning_tokens: int = 0  # a reasoning parser's split (chat): generated tokens
    # 0..N-1 are reasoning deltas, the rest content
    force_usage: bool = False  # vLLM's --enable-force-include-usage: usage in every
    # token event (the tokens so far) and a usage event at the end, asked or not

    @property
    def served_models(self) -> tuple[str, ...]:
        return (self.model, *self.aliases)


def _limit(chat: bool, body: dict[str, Any]) -> int | None:
    """The length bound as vLLM reads it: chat takes max_completion_tokens over
    max_tokens; completions ignore max_completion_tokens and default max_tokens to 16."""
    limit = body.get("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        limit = body["max_completion_tokens"]
    elif not chat and limit is None:
        limit = _COMPLETIONS_MAX_TOKENS
    return limit if isinstance(limit, int) else None


class FakeVllm:
    def __init__(self, config: FakeConfig) -> None:
        self.config = config
        self.stats = FakeStats()
        self.created = int(time.time())  # fixed, so equal requests get equal bytes
        self._slots = asyncio.Semaphore(config.max_num_seqs)
        self._prefix_cache = PrefixCache()
        self.responses: dict[str, dict[str, Any]] = {}  # stored Responses API answers
        self.adapters: dict[str, str] = {}  # LoRA adapters loaded at run time: name -> path

    def served(self) -> tuple[str, ...]:
        return (*self.config.served_models, *self.adapters)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer as vLLM; a body of a shape this fake cannot read (a field of the wrong
        type, not JSON) gets vLLM's 400 for a request its validation rejects."""
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)
        try:
            await self._route(scope, receive, sending)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            if started:
                raise
            await send_json(send, 400, {"error": {
                "message": f"invalid request ({type(exc).__name__}: {exc})",
                "type": "BadRequestError", "param": None, "code": 400}})

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if path.startswith(_GUARDED):
            headers = dict(scope["headers"])
            authorization, api_key = headers.get(b"authorization"), headers.get(b"x-api-key")
            traceparent = headers.get(b"traceparent")
            self.stats.record_credentials(
                authorization.decode() if authorization is not None
                else None if api_key is None else f"x-api-key {api_key.decode()}",
                None if traceparent is None else traceparent.decode())
            if self.config.api_key is not None and authorization != (
                    b"Bearer " + self.config.api_key.encode()):
                await send_json(send, 401, {"error": "Unauthorized"})  # as vLLM's
                return
        if path in ("/metrics", "/metrics/"):  # vLLM: the instrumentator's, prometheus
            await send_bytes(send, 200, render(self.stats, self.config.model,
                                               self.config.kv_capacity_tokens,
                                               requested_names(scope["query_string"])),
                             [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")])
        elif path in ("/health", "/ping"):
            await send_bytes(send, 200, b"", [])
        elif path == "/tokenize":
            await self._tokenize(receive, send)
        elif path == "/v1/models":
            await send_json(send, 200, {"object": "list", "data": [
                {"id": name, "object": "model", "created": self.created, "owned_by": "vllm",
                 "root": self.config.model, "parent": None,
                 "max_model_len": self.config.max_model_len}
                for name in self.served()]})
        elif path == fake_apis.PREFIX or path.startswith(fake_apis.PREFIX + "/"):
            await fake_apis.handle(self, scope, receive, send)
        elif path in (fake_apis.MESSAGES, fake_apis.MESSAGES + "/count_tokens"):
            await fake_apis.messages(self, scope, receive, send)
        elif path == "/v1/embeddings":
            await self._embeddings(receive, send)
        elif path in ("/v1/chat/completions", "/v1/completions"):
            await self._completion(path == "/v1/chat/completions", scope, receive, send)
        elif path in _AUDIO_ROUTES:
            await self._audio(scope, receive, send)
        elif path in _LORA_ROUTES and self.config.lora_runtime:
            await self._lora(path == _LORA_ROUTES[0], receive, send)
        else:
            await send_json(send, 404, {"detail": "Not Found"})

    async def _audio(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's speech-to-text routes: a form upload (parsed here with the standard
        library's MIME parser); the "transcript" names the model and the file's size
        and digest, so a test sees the upload arrived whole."""
        try:
            raw = await read_body({}, receive, _MAX_BODY)
        except ClientGone:
            return
        content_type = dict(scope["headers"]).get(b"content-type", b"")
        form = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            b"Content-Type: " + content_type + b"\r\n\r\n" + raw)
        fields: dict[str, Any] = {}
        for part in form.iter_parts():
            name = part.get_param("name", header="content-disposition")
            payload = part.get_payload(decode=True)
            if isinstance(name, str) and isinstance(payload, bytes):
                fields[name] = payload if part.get_filename() else payload.decode()
        upload = fields.pop("file", b"")
        fields["file_sha256"] = hashlib.sha256(upload).hexdigest()
        if await self.refused(fields, fields.get("model") or self.config.model, send):
            return
        text = f"{fields.get('model')} heard {len(upload)} bytes"
        if fields.get("stream") != "true":
            await send_json(send, 200, {"text": text,
                                        "usage": {"type": "duration", "seconds": 1}})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for offset, word in enumerate(text.split()):  # vLLM's chunks, one per word here
            if await self.cut_at(offset, send):
                return
            chunk = {"object": "transcription.chunk",
                     "choices": [{"delta": {"content": word + " "}}]}
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"data: " + orjson.dumps(chunk) + b"\n\n"})
            await asyncio.sleep(self.config.tpot_s)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async def cut_at(self, offset: int, send: Send) -> bool:
        """Whether a stream ends before its `offset`-th token (`die_after_tokens`,
        `end_after_tokens`, `garble_after_tokens`, `refuse_after_tokens`); it has ended
        then."""
        cfg = self.config
        if offset not in (cfg.die_after_tokens, cfg.end_after_tokens, cfg.garble_after_tokens,
                          cfg.refuse_after_tokens):
            return False
        self.stats.dropped += 1
        if offset == cfg.refuse_after_tokens:
            await send({"type": "http.response.body", "more_body": False,
                        "body": b"data: " + REFUSAL + b"\n\ndata: [DONE]\n\n"})
            return True
        if offset == cfg.garble_after_tokens:  # a token event whose content is a number
            await send({"type": "http.response.body", "more_body": True,
                        "body": b'data: {"choices":[{"index":0,"delta":{"content":5}}]}\n\n'})
        if offset == cfg.end_after_tokens:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True  # else, returning mid-response: uvicorn closes the connection

    async def _lora(self, load: bool, receive: Receive, send: Send) -> None:
        """vLLM's runtime LoRA routes, with its answers (OpenAIServingModels)."""
        try:
            body = orjson.loads(await read_body({}, receive, _MAX_BODY))
        except ClientGone:
            return
        name = body.get("lora_name")
        if load and name in self.adapters and not body.get("load_inplace"):
            await send_json(send, 400, {"error": {
                "message": f"The lora adapter '{name}' has already been loaded. If you "
                           "want to load the adapter in place, set 'load_inplace' to True.",
                "type": "InvalidUserInput", "param": None, "code": 400}})
        elif not load and name not in self.adapters:
            await send_json(send, 404, {"error": {
                "message": f"The lora adapter '{name}' cannot be found.",
                "type": "NotFoundError", "param": None, "code": 404}})
        else:
            if load:
                self.adapters[name] = body["lora_path"]
            else:
                del self.adapters[name]
            verb = "added" if load else "removed"
            await send_bytes(send, 200, f"Success: LoRA adapter '{name}' {verb} "
                             "successfully.".encode(), [])

    async def _completion(self, chat: bool, scope: Scope, receive: Receive, send: Send) -> None:
        if (taken := await self.take(receive, send)) is None:
            return
        body, model = taken
        limit, room = _limit(chat, body), self.config.max_model_len
        if limit is not None and limit > room:  # vLLM's check (it clamps to the room left)
            await send_json(send, 400, {"error": {
                "message": f"max_tokens={limit} cannot be greater than max_model_len={room}. "
                           "Please request fewer output tokens.",
                "type": "BadRequestError", "param": "max_tokens", "code": 400}})
            return
        job = self._plan(chat, scope, body, model)
        await self.cancellable(receive, lambda: self._admitted(job, body, send))

    async def _embeddings(self, receive: Receive, send: Send) -> None:
        """A pooling server's `/v1/embeddings`: one 8-float vector per input string,
        fixed by the string; the injected failures apply as to completions."""
        if (taken := await self.take(receive, send)) is None:
            return
        body, model = taken
        texts = body.get("input", "")
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, list):
            await send_json(send, 400, {"error": {"message": "`input` must be a string or "
                                                  "a list", "type": "BadRequestError"}})
            return
        texts = [str(t) for t in texts]
        data = [{"index": i, "object": "embedding",
                 "embedding": [(b - 128) / 128 for b in hashlib.blake2b(
                     text.encode(), digest_size=8).digest()]}
                for i, text in enumerate(texts)]
        tokens = sum(len(text_token_ids(text)) for text in texts)

        async def answer() -> None:
            await send_json(send, 200, {
                "id": "embd-fake", "object": "list", "created": self.created,
                "model": model, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                          "completion_tokens": 0}})
            self.stats.finished += 1
        await self.cancellable(receive, answer)

    async def take(self, receive: Receive, send: Send) -> tuple[dict[str, Any], str] | None:
        """The request's body and model, or None once answered here (`refused`) or
        the client left."""
        try:
            body = orjson.loads(await read_body({}, receive, _MAX_BODY))
        except ClientGone:
            return None
        model = body.get("model") or self.config.model
        return None if await self.refused(body, model, send) else (body, model)

    async def refused(self, body: dict[str, Any], model: str, send: Send) -> bool:
        """Count the request; answer it here if its model is not served or a failure
        is injected."""
        cfg, stats = self.config, self.stats
        stats.record(body)
        if model not in self.served():
            await send_json(send, 404, {"error": {
                "message": f"The model `{model}` does not exist.", "type": "NotFoundError",
                "param": "model", "code": 404}})
            return True
        if cfg.fail_status and (cfg.fail_first is None or stats.requests <= cfg.fail_first):
            await send_json(send, cfg.fail_status, {"error": {"message": "injected failure"}})
            return True
        return False

    async def cancellable(self, receive: Receive, work: Callable[[], Awaitable[None]]
                           ) -> None:
        """Run `work` (after forever, with `hang`) until the client goes away."""
        disconnect = _Disconnect(receive)
        try:
            if self.config.hang:
                await asyncio.Event().wait()  # until the client goes away
            await work()
        except asyncio.CancelledError:
            if not disconnect.gone:
                raise  # server shutdown, not the client
            disconnect.task.uncancel()
            self.stats.cancelled += 1
        finally:
            disconnect.close()

    async def _tokenize(self, receive: Receive, send: Send) -> None:
        """vLLM's `/tokenize`: chat messages (with BOS) or a text prompt."""
        try:
            body = orjson.loads(await read_body({}, receive, _MAX_BODY))
        except ClientGone:
            return
        self.stats.tokenized.append(body)
        if "messages" in body:
            tokens = prompt_token_ids(True, body)
        else:
            bos = [BOS_ID] if body.get("add_special_tokens", True) else []
            tokens = bos + text_token_ids(str(body.get("prompt", "")))
        await send_json(send, 200, {"count": len(tokens), "max_model_len": 4096,
                                    "tokens": tokens, "token_strs": None})

    def _plan(self, chat: bool, scope: Scope, body: dict[str, Any], model: str) -> Completion:
        cfg = self.config
        limit = _limit(chat, body)
        # Where the "model" would emit EOS: after eos_after tokens if configured, else
        # never when max_tokens bounds the request, else after default_tokens.
        natural = None if body.get("ignore_eos") else (
            cfg.eos_after if cfg.eos_after is not None
            else None if limit else cfg.default_tokens)
        if natural is not None and (limit is None or natural < limit):
            tokens, reason = natural, "stop"
        else:
            tokens, reason = int(limit or cfg.default_tokens), "length"
        prompt_ids = prompt_token_ids(chat, body)
        if len(prompt_ids) + tokens > cfg.max_model_len:  # as vLLM: up to the context
            tokens, reason = max(cfg.max_model_len - len(prompt_ids), 0), "length"
        request_id = dict(scope["headers"]).get(b"x-request-id", b"fake").decode()
        return Completion(chat, ("chatcmpl-" if chat else "cmpl-") + request_id, model,
                          self.created, prompt_ids, first_index(prompt_ids), tokens, reason,
                          bool(body.get("return_token_ids")),
                          cfg.reasoning_tokens if chat else 0)

    async def _admitted(self, job: Completion, body: dict[str, Any], send: Send) -> None:
        """Run `job` once a sequence slot is free, accounting like vLLM's scheduler."""
        stats = self.stats
        stats.waiting += 1
        stats.peak = max(stats.peak, stats.running + stats.waiting)
        try:
            await self._slots.acquire()
        finally:
            stats.waiting -= 1
        stats.running += 1
        held = len(job.prompt_ids)
        stats.kv_tokens += held
        stats.prompt_tokens += held
        stats.prefix_queries += held
        stats.prefix_hits += self._prefix_cache.lookup(job.prompt_ids)
        try:
            if body.get("stream"):
                await self._stream(job, include_usage(body) or self.config.force_usage, send)
            else:
                await self._whole(job, send)
        finally:
            stats.running -= 1
            stats.kv_tokens -= held
            self._slots.release()

    async def _stream(self, job: Completion, usage: bool, send: Send) -> None:
        cfg, stats = self.config, self.stats
        wire = StreamWire(job)
        loop = asyncio.get_running_loop()
        started = loop.time()
        due = started + cfg.ttft_s
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        last, generated = started, 0
        try:
            for offset in range(job.tokens):
                if await self.cut_at(offset, send):
                    return
                delay = due - loop.time()
                await asyncio.sleep(delay if delay > 0 else 0)
                now = loop.time()
                (stats.itl if offset else stats.ttft).observe(now - last)
                last, due = now, due + cfg.tpot_s
                chunk = wire.token(offset)
                if cfg.force_usage:
                    chunk = chunk[:-3] + b',"usage":' + orjson.dumps(usage_json(
                        len(job.prompt_ids), offset + 1)) + b"}\n\n"
                generated += 1
                stats.kv_tokens += 1
                stats.generation_tokens += 1
                await send({"type": "http.response.body", "more_body": True,
                            "body": wire.opening + chunk if offset == 0 else chunk})
            await send({"type": "http.response.body", "body": wire.closing(usage),
                        "more_body": False})
            stats.finished += 1
        finally:
            stats.kv_tokens -= generated

    async def _whole(self, job: Completion, send: Send) -> None:
        cfg, stats = self.config, self.stats
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.sleep(cfg.ttft_s)
        stats.ttft.observe(loop.time() - started)
        await asyncio.sleep(cfg.tpot_s * max(0, job.tokens - 1))
        body = full_body(job)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*_JSON, (b"content-length", str(len(body)).encode())]})
        if cfg.die_after_tokens is not None:
            stats.dropped += 1
            await send({"type": "http.response.body", "body": body[:len(body) // 2],
                        "more_body": True})
            return  # uvicorn closes the connection: the client sees a short body
        stats.generation_tokens += job.tokens
        await send({"type": "http.response.body", "body": body, "more_body": False})
        stats.finished += 1


class _Disconnect:
    """Cancels the request's task when the client disconnects (vLLM aborts then)."""

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self._watcher = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self.task.cancel()

    def close(self) -> None:
        self._watcher.cancel()


def include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options") or {}
    return bool(isinstance(options, dict) and options.get("include_usage"))


@dataclass(frozen=True, slots=True)
class RunningFake:
    app: FakeVllm
    url: str


@contextlib.asynccontextmanager
async def serve_fake(config: FakeConfig, host: str = "127.0.0.1", port: int = 0
                     ) -> AsyncIterator[RunningFake]:
    """Serve a fake in the current event loop until the block ends."""
    app = FakeVllm(config)
    async with uvicorn_in_loop(uvicorn.Config(
            app, host=host, port=port, loop="none", http="httptools", lifespan="off",
            access_log=False, log_config=None, timeout_graceful_shutdown=1)) as url:
        yield RunningFake(app, url)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="fake vLLM OpenAI server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model", default="fake")
    parser.add_argument("--alias", action="append", default=[], help="another served name")
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--tpot-ms", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=16,
                        help="a chat answer's length without max_tokens")
    parser.add_argument("--eos-after", type=int)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--fail-status", type=int)
    parser.add_argument("--fail-first", type=int)
    parser.add_argument("--die-after-tokens", type=int)
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--api-key", help="as vLLM's: /v1/* needs `Bearer <key>`")
    parser.add_argument("--lora-runtime", action="store_true",
                        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    config = FakeConfig(
        model=args.model, aliases=tuple(args.alias), ttft_s=args.ttft_ms / 1000,
        tpot_s=args.tpot_ms / 1000, default_tokens=args.tokens, eos_after=args.eos_after,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        fail_status=args.fail_status,
        fail_first=args.fail_first, die_after_tokens=args.die_after_tokens, hang=args.hang,
        api_key=args.api_key, lora_runtime=args.lora_runtime)
    uvicorn.run(FakeVllm(config), host=args.host, port=args.port, loop="uvloop",
                http="httptools", lifespan="off", access_log=False, log_level=args.log_level)


if __name__ == "__main__":
    main()
