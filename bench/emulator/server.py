"""The emulated vLLM server: the fake's HTTP surface on top of an `Engine`.

`EmulatedVllm` is a `FakeVllm` (same routes, wire bytes, token-id rule, `/metrics`,
disconnect handling and failure injection) whose completions are produced by the
engine's steps instead of a fixed pace, and which answers over-long requests with
vLLM's 400s. `FleetApp` serves many instances from one process: each on its own
port, or all on one port under `/<name>/...` paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn

from bench.emulator.engine import Engine
from bench.emulator.engine import Sequence as EngineSequence
from bench.emulator.frontend import Frontend
from bench.emulator.profile import Profile
from bench.fakes.fake_metrics import FakeStats
from bench.fakes.fake_vllm import FakeConfig, FakeVllm, include_usage
from bench.fakes.fake_wire import Completion, StreamWire, full_body
from proxy.asgi import Receive, Scope, Send, send_json
from proxy.http.server import uvicorn_in_loop


class EmulatedVllm(FakeVllm):
    def __init__(self, config: FakeConfig, profile: Profile) -> None:
        super().__init__(dataclasses.replace(
            config, kv_capacity_tokens=profile.kv_tokens, max_model_len=profile.max_model_len,
            max_num_seqs=profile.max_num_seqs))
        self.profile = profile
        self.stats = FakeStats(keep_bodies=False)
        self.engine = Engine(profile, self.stats)
        self.frontend = Frontend(profile.frontend_speed_while_stepping)
        self.engine.on_busy = self.frontend.engine_busy

    async def _admitted(self, job: Completion, body: dict[str, Any], send: Send) -> None:
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        error, job = length_check(job, self.profile.max_model_len)
        if error:
            await send_json(send, 400, {"error": {**error, "type": "BadRequestError",
                                                  "code": 400}})
            return
        # the API server's CPU, then waits that are not CPU (hops between processes)
        handed = await self.frontend.run(self.profile.request_overhead_s) \
            + self.profile.request_latency_s
        if handed > loop.time():
            await asyncio.sleep(handed - loop.time())
        seq = EngineSequence(job.prompt_ids, job.start, job.tokens, arrival)
        self.engine.add(seq, at=handed)
        try:
            if body.get("stream"):
                await self._stream_steps(seq, job, include_usage(body), send)
            else:
                while not seq.done:
                    await seq.progress(seq.output)
                await _send_body(send, job)
        finally:
            self.engine.abort(seq)  # a no-op once finished; frees KV if the client left

    async def _stream_steps(self, seq: EngineSequence, job: Completion, usage: bool,
                            send: Send) -> None:
        wire = StreamWire(job)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        sent = 0
        while sent < job.tokens:
            await seq.progress(sent)
            ready = seq.output
            if self.profile.chunk_overhead_s:  # from the step that made the token
                await self.frontend.run(self.profile.chunk_overhead_s, seq.last_token_at)
                ready = seq.output  # tokens made meanwhile go out in this chunk
            events = b"".join([wire.token(offset) for offset in range(sent, ready)])
            await send({"type": "http.response.body", "more_body": True,
                        "body": wire.opening + events if sent == 0 else events})
            sent = ready
        await send({"type": "http.response.body", "body": wire.closing(usage),
                    "more_body": False})


async def _send_body(send: Send, job: Completion) -> None:
    body = full_body(job)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def length_check(job: Completion, max_model_len: int) -> tuple[dict[str, Any] | None, Completion]:
    """vLLM's context-length rules: an error body, or the job with its output capped."""
    prompt = len(job.prompt_ids)
    if prompt > max_model_len:
        return {"message": f"This model's maximum context length is {max_model_len} tokens. "
                f"However, your prompt contains {prompt} input tokens, which exceeds this "
                "limit even without any output tokens. Please reduce the length of the "
                f"input prompt. (parameter=input_tokens, value={prompt})",
                "param": "input_tokens"}, job
    if job.tokens > max_model_len:
        return {"message": f"max_tokens={job.tokens} cannot be greater than "
                f"max_model_len={max_model_len}. Please request fewer output tokens. "
                f"(parameter=max_tokens, value={job.tokens})", "param": "max_tokens"}, job
    room = max_model_len - prompt
    if room < 1:
        return {"message": f"max_tokens must be at least 1, got {room}. "
                f"(parameter=max_tokens, value={room})", "param": "max_tokens"}, job
    if job.tokens > room:  # vLLM shortens the answer to fit the context
        job = dataclasses.replace(job, tokens=room, finish_reason="length")
    return None, job


class FleetApp:
    """Dispatches to an instance by the port a connection came in on, else by path.

    `GET /emulator/stats` on any of them sums the engines of this process: how far
    the loop ran behind the emulated schedule tells whether the process keeps up."""

    def __init__(self) -> None:
        self.by_port: dict[int, EmulatedVllm] = {}
        self.by_name: dict[str, EmulatedVllm] = {}

    def apps(self) -> list[EmulatedVllm]:
        return list(self.by_port.values()) + list(self.by_name.values())

    def stats(self) -> dict[str, float]:
        engines = [app.engine for app in self.apps()]
        return {"instances": len(engines), "steps": sum(e.steps for e in engines),
                "busy_s": sum(e.busy_s for e in engines),
                "lag_s": sum(e.lag_s for e in engines),
                "running": sum(len(e.running) for e in engines),
                "waiting": sum(len(e.waiting) for e in engines),
                "finished": sum(app.stats.finished for app in self.apps()),
                "generation_tokens": sum(app.stats.generation_tokens for app in self.apps())}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/emulator/stats":
            await send_json(send, 200, self.stats())
            return
        app = self.by_port.get(scope["server"][1]) if scope.get("server") else None
        if app is None:
            name, _, rest = scope["path"][1:].partition("/")
            app = self.by_name.get(name)
            if app is None:
                await send_json(send, 404, {"detail": "Not Found"})
                return
            scope = {**scope, "path": "/" + rest}
        await app(scope, receive, send)


@dataclass(frozen=True, slots=True)
class Instance:
    name: str
    profile: Profile
    model: str
    port: int = 0  # 0: any free port; unused when the fleet shares one port


@dataclass(frozen=True, slots=True)
class RunningFleet:
    apps: list[EmulatedVllm]
    urls: list[str]


def listen_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


@contextlib.asynccontextmanager
async def serve_fleet(instances: Sequence[Instance], host: str = "127.0.0.1",
                      shared_port: int | None = None) -> AsyncIterator[RunningFleet]:
    """Serve every instance in the current loop until the block ends.

    Each instance listens on its own port, or, with `shared_port` (0: any), all share
    one port and instance `name` answers under `http://host:port/name`."""
    fleet = FleetApp()
    apps = [EmulatedVllm(FakeConfig(model=spec.model), spec.profile) for spec in instances]
    sockets: list[socket.socket] = []
    urls: list[str] = []
    try:
        if shared_port is not None:
            sockets.append(listen_socket(host, shared_port))
            port = sockets[0].getsockname()[1]
            for spec, app in zip(instances, apps, strict=True):
                fleet.by_name[spec.name] = app
                urls.append(f"http://{host}:{port}/{spec.name}")
        else:
            for spec, app in zip(instances, apps, strict=True):
                sockets.append(listen_socket(host, spec.port))
                port = sockets[-1].getsockname()[1]
                fleet.by_port[port] = app
                urls.append(f"http://{host}:{port}")
        config = uvicorn.Config(fleet, host=host, loop="none", http="httptools",
                                lifespan="off", access_log=False, log_config=None,
                                timeout_graceful_shutdown=1)
        async with uvicorn_in_loop(config, sockets):
            yield RunningFleet(apps, urls)
    finally:
        for sock in sockets:
            sock.close()
