"""Run the proxy under uvicorn (uvloop + httptools): blocking for the CLI, or as a
task in the current event loop for tests and benchmarks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn

from proxy.app import LanewayApp
from proxy.config import Settings


def uvicorn_config(settings: Settings, app: LanewayApp) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_config=None,  # the CLI configures logging once
        timeout_graceful_shutdown=settings.server.shutdown_timeout_s,
        timeout_keep_alive=settings.server.keep_alive_s,
    )


def run(settings: Settings) -> None:
    uvicorn.Server(uvicorn_config(settings, LanewayApp(settings))).run()


@dataclass(frozen=True, slots=True)
class RunningProxy:
    app: LanewayApp
    url: str


@contextlib.asynccontextmanager
async def serve_in_loop(settings: Settings) -> AsyncIterator[RunningProxy]:
    """Start the proxy on `settings.server` (port 0 = any free port) until the block ends."""
    app = LanewayApp(settings)
    server = uvicorn.Server(uvicorn_config(settings, app))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()  # re-raise the startup failure
                raise RuntimeError("proxy exited during startup")
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield RunningProxy(app, f"http://{settings.server.host}:{port}")
    finally:
        server.should_exit = True
        await task
