"""The model-routed endpoints that generate no stream of tokens: embeddings, scoring,
reranking, pooling, classification, (de)tokenization, and speech to text.

vLLM serves these beside the completion routes (`/tokenize`), or instead of them on
a pooling model (`--runner pooling`: `/v1/embeddings`, `/v1/score`, `/v1/rerank`, …).
They produce no tokens, so the generation policies (length prediction, SLOs,
migration) have nothing to work with: a request goes to the healthy backend of its
`model` with the fewest requests open, with the same auth, limits, retries before
the first byte, timeouts and OpenAI-shaped errors as a completion. Bodies are relayed
untouched both ways (but for a model group's member name); the response says which
backend answered (`x-laneway-backend`). The audio routes take a form upload
(`multipart/form-data`): their `model` is a form field (proxy/http/multipart.py), and a key
is charged the request, not the audio's bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import orjson

from proxy.admission.auth import Grant
from proxy.admission.flow_control import Place
from proxy.asgi import (
    ClientGone,
    Receive,
    Scope,
    Send,
    header_map,
    read_body,
    until_disconnect,
)
from proxy.errors import InvalidRequest, ProxyError
from proxy.http import multipart
from proxy.observability.access_log import note, wait_ms
from proxy.relay.stream_accounting import StreamTally, body_usage
from proxy.relay.upstream import Opened, UpstreamFailure, exhausted, forward_headers, relay_answer
from proxy.request_context import (
    form_xargs_without_controls,
    named_model,
    parse_body,
    request_id,
    without_client_controls,
)
from proxy.runtime import Runtime
from proxy.types import Outcome

_MAX_MODEL_CHARS = 1024
AUDIO_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")  # form uploads
PATHS = ("/v1/embeddings", "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank",
         "/pooling", "/classify", "/tokenize", "/detokenize", "/v1/messages/count_tokens",
         *AUDIO_PATHS)


@dataclasses.dataclass(frozen=True, slots=True)
class _Body:
    """A request's body and the model it names; `span`: where a form upload's `model`
    field lies (None: a JSON body)."""

    raw: bytes
    model: str
    span: tuple[int, int] | None = None
    stream: bool = False  # a form upload's `stream=true`: the answer is relayed as it streams

    def naming(self, model: str) -> bytes:
        """The body as sent to a backend that serves it as `model` (a group's member, a
        fallback); untouched when that is the model asked for."""
        if model == self.model:
            return self.raw
        if self.span is not None:
            return multipart.replaced(self.raw, self.span, model)
        return orjson.dumps(orjson.loads(self.raw) | {"model": model})


async def handle_passthrough(rt: Runtime, scope: Scope, receive: Receive, send: Send) -> None:
    path: str = scope["path"]
    headers = header_map(scope)
    try:
        server = rt.settings.server
        rt.auth.key_of(headers)  # a 401 before a stranger's body is read and parsed
        raw = await read_body(headers, receive, server.max_body_bytes, server.body_timeout_s)
        body = _read(raw, headers, path, rt.default_model(), server.max_json_depth)
        model = body.model
        # No output tokens: the body bounds the input the key is charged for (an audio
        # file's bytes are no text: its request is counted, not its bytes).
        chars = 0 if body.span is not None else len(raw)
        grant, send = rt.admit(scope, send, model,
                               lambda: rt.auth.admit_model(headers, model, chars, 0),
                               anthropic=path.startswith("/v1/messages"))
        place = rt.queue_place(grant, headers)
    except ClientGone:
        return
    except ProxyError as err:
        await rt.refuse(send, err, anthropic=path.startswith("/v1/messages"))
        return
    upstream_headers = forward_headers(scope["headers"], not rt.auth.cfg.enabled)
    call = _Call(rt, path, body, upstream_headers, send, grant, request_id(headers), place)
    await until_disconnect(receive, call.run(), call.left)
    note(scope, queued_ms=wait_ms(call.queued_s))


def _read(raw: bytes, headers: dict[str, str], path: str, default_model: str | None,
          max_depth: int) -> _Body:
    """The body and the model it names (`default_model` if it names none, then written
    into the body: not on the Messages API's routes, whose schema requires one)."""
    if path not in AUDIO_PATHS:
        data = parse_body(raw, max_depth)
        if (kept := without_client_controls(data)) is not data:
            data, raw = kept, orjson.dumps(kept)
        if path.startswith("/v1/messages"):
            default_model = None
        model = named_model(data, default_model, f" on {path}")
        return _Body(raw if data.get("model") == model else
                     orjson.dumps(data | {"model": model}), model)
    boundary = multipart.boundary_of(headers.get("content-type", ""))
    if boundary is None:
        raise InvalidRequest(f"{path} takes a multipart/form-data upload (the audio file "
                             "and the request's fields), as OpenAI's does.")
    fields = ("model", "stream", "vllm_xargs")
    spans = multipart.field_spans(raw, boundary, *fields)
    xargs = spans.get("vllm_xargs")
    if xargs is not None and (clean := form_xargs_without_controls(
            raw[xargs[0]:xargs[1]])) is not None:  # as from a JSON body's `vllm_xargs`
        raw = multipart.replaced(raw, xargs, clean)
        spans = multipart.field_spans(raw, boundary, *fields)
    span, stream = spans.get("model"), spans.get("stream")
    try:
        model = raw[span[0]:span[1]].decode() if span is not None else ""
    except UnicodeDecodeError:
        model = ""
    if not model or len(model) > _MAX_MODEL_CHARS:
        raise InvalidRequest(f"The form field `model` is required on {path}: it decides "
                             "which backends may answer.", param="model")
    return _Body(raw, model, span,
                 stream is not None and raw[stream[0]:stream[1]].strip().lower() == b"true")


class _Call:
    """One pass-through request, from the first pick to the response (or its error)."""

    def __init__(self, rt: Runtime, path: str, body: _Body, headers: dict[str, str],
                 send: Send, grant: Grant | None, rid: str, place: Place) -> None:
        self.rt, self.path, self.model, self.body, self.headers, self.send = (
            rt, path, body.model, body, headers, send)
        self.grant, self.place = grant, place
        self.queued_s = 0.0  # time it waited in flow control's queue
        self.request_id = rid
        self.started = time.monotonic()
        self.client_gone = False
        self.backend_name = "-"  # the backend being tried, for metrics

    def left(self) -> None:
        """The client disconnected before the answer was sent."""
        self.client_gone = True

    async def run(self) -> None:
        outcome: Outcome | None = None
        try:
            opened = await self._open()
            tally = StreamTally(time.monotonic())
            await relay_answer(opened, self.send, self.request_id, tally,
                               self.rt.settings.upstream.read_timeout_s,
                               self.rt.count_upstream_error)
            # a stream that broke on the way is the backend's failure, not an answer
            status = 502 if tally.failed else opened.status
            outcome = self._outcome(opened.backend.name, status, opened.head)
        except ProxyError as err:
            await self.rt.refuse(self.send, err, anthropic=self.path.startswith("/v1/messages"))
        except asyncio.CancelledError:
            if self.client_gone:
                self.rt.metrics.disconnects.labels(self.model, self.backend_name).inc()
                outcome = self._outcome(self.backend_name, 499, b"")
            raise
        finally:
            self.rt.auth.settle(self.grant, outcome)
            if outcome is not None:
                self.rt.metrics.observe_passthrough(self.path, self.model, outcome)

    async def _open(self) -> Opened:
        """The first backend's full response; on failure the next backend's, then those
        of the model's fallbacks (`model_fallbacks`)."""
        rt = self.rt
        failures: list[UpstreamFailure] = []
        rounds = 0
        while True:
            previous = self.model
            for target in rt.models_to_try(self.model):
                if target != previous:
                    rt.falling_back(self.request_id, self.model, previous, target, failures)
                    previous = target
                if (opened := await self._attempts(target, failures)) is not None:
                    return opened
            pause = rt.retry_pause(self.model, self.started, rounds, failures)
            if pause is None:
                raise exhausted(self.model, failures, rt.settings.server.retry_after_s)
            await asyncio.sleep(pause)
            failures.clear()
            rounds += 1

    async def _attempts(self, target: str, failures: list[UpstreamFailure]
                        ) -> Opened | None:
        """Up to `upstream.max_attempts` backends of `target`: the first answer, or None
        when none answered (`failures` says why)."""
        rt = self.rt
        tried: list[str] = []
        for _ in range(rt.settings.upstream.max_attempts):
            held = time.monotonic()
            view = await rt.flow.view(target, tried, self.place)  # may wait for room
            self.queued_s += time.monotonic() - held
            if not view.candidates:
                break
            backend, _load = rt.least_inflight.pick(view)
            tried.append(backend.name)
            self.backend_name = backend.name
            body = self.body.naming(rt.registry.model_on(backend, target))
            with rt.registry.guard(backend.name):
                try:
                    return await rt.upstream.open(backend, self.path, body, self.headers,
                                                  stream=self.body.stream)
                except UpstreamFailure as failure:
                    failures.append(failure)
                    rt.upstream_failed(failure, target)
        return None

    def _outcome(self, backend: str, status: int, body: bytes) -> Outcome:
        prompt_tokens = None  # None: settled at the up-front estimate
        if status == 200:
            prompt_tokens = body_usage(body)[0] if self.path != "/tokenize" else _count(body)
        return Outcome(
            request_id=self.request_id, model=self.model, backend=backend,
            policy="passthrough", status=status, ok=status == 200, started_at=self.started,
            ttft_s=None, e2e_s=time.monotonic() - self.started, completion_tokens=0,
            prompt_tokens=prompt_tokens)


def _count(body: bytes) -> int | None:
    """`count` of a vLLM `/tokenize` answer."""
    with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
        count = orjson.loads(body).get("count")
        return count if isinstance(count, int) else None
    return None
