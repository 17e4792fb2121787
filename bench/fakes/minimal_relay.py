"""The floor of laneway's stack: a bare ASGI relay on uvicorn + aiohttp, nothing else.

`bench.studies.overhead` runs it beside the proxy so the report can say how much of the
proxy's CPU per token is laneway's own work and how much is the HTTP stack's.
Usage: python -m bench.fakes.minimal_relay UPSTREAM_URL PORT
"""

from __future__ import annotations

import sys

import aiohttp
import uvicorn

from proxy.asgi import Receive, Scope, Send
from proxy.config import UpstreamConfig

KEEPALIVE_S = UpstreamConfig().keepalive_s


class MinimalRelay:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                # idle connections dropped before the upstream's own keep-alive (uvicorn's
                # 5 s) drops them, as laneway's default upstream.keepalive_s does: a
                # connection reused as the upstream closes it fails the request
                self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                    limit=0, keepalive_timeout=KEEPALIVE_S))
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        assert self.session is not None
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        async with self.session.post(self.upstream + scope["path"], data=body,
                                     headers={"content-type": "application/json"}) as resp:
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": [(b"content-type", b"text/event-stream")]})
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})


if __name__ == "__main__":
    uvicorn.run(MinimalRelay(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]),
                loop="uvloop", http="httptools", access_log=False, log_level="warning")
