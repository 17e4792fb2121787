"""Run the proxy under uvicorn (uvloop + httptools, with bounds on each connection's
headers and deadlines: proxy/http/protocol.py): blocking for the CLI, or as a task in
the current event loop for tests and benchmarks."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn

from policies.base import Policy
from proxy.config import Settings
from proxy.http.app import LanewayApp
from proxy.http.protocol import ConnectionLimits, guarded_protocol


def connection_limits(settings: Settings) -> ConnectionLimits:
    server = settings.server
    return ConnectionLimits(
        header_timeout_s=server.header_timeout_s, request_timeout_s=server.request_timeout_s,
        keep_alive_s=server.keep_alive_s, write_timeout_s=server.write_timeout_s,
        max_header_bytes=server.max_header_bytes, max_header_count=server.max_header_count,
        max_body_bytes=server.max_body_bytes,
        max_body_bytes_in_flight=server.max_body_bytes_in_flight)


def uvicorn_config(settings: Settings, app: LanewayApp) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        loop="uvloop",
        http=guarded_protocol(connection_limits(settings), app.refused_by_server),
        lifespan="on",
        access_log=False,
        log_config=None,  # the CLI configures logging once
        timeout_graceful_shutdown=settings.server.shutdown_timeout_s,
        timeout_keep_alive=settings.server.keep_alive_s,
        ssl_certfile=settings.server.tls_certfile,
        ssl_keyfile=settings.server.tls_keyfile,
    )


def run(settings: Settings, config_path: str | None = None, policy: Policy | None = None
        ) -> None:
    """Serve until SIGTERM/SIGINT; then open streams get `server.shutdown_timeout_s` to
    finish (uvicorn's graceful shutdown) before the runtime closes. SIGHUP re-reads
    `config_path`. `policy`: the one the config check built from `settings.policy`
    (built again at start when None)."""
    app = LanewayApp(settings, config_path, policy)
    uvicorn.Server(uvicorn_config(settings, app)).run()


@dataclass(frozen=True, slots=True)
class RunningProxy:
    app: LanewayApp
    url: str


@contextlib.asynccontextmanager
async def serve_in_loop(settings: Settings) -> AsyncIterator[RunningProxy]:
    """Start the proxy on `settings.server` (port 0 = any free port) until the block ends."""
    app = LanewayApp(settings)
    async with uvicorn_in_loop(uvicorn_config(settings, app)) as url:
        yield RunningProxy(app, url)


@contextlib.asynccontextmanager
async def uvicorn_in_loop(config: uvicorn.Config, sockets: list[socket.socket] | None = None
                          ) -> AsyncIterator[str]:
    """Serve `config.app` as a task of the running loop; yield its URL; stop on exit.

    `sockets`: listen on these bound sockets instead of `config.host`/`port`; the URL
    is the first one's."""
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=sockets))
    try:
        while not server.started:
            if task.done():
                task.result()  # re-raise the startup failure
                raise RuntimeError("server exited during startup")
            await asyncio.sleep(0.005)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"{'https' if config.is_ssl else 'http'}://{config.host}:{port}"
    finally:
        server.should_exit = True
        await task
