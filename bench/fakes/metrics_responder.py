"""Many static vLLM `/metrics` endpoints in one process, for the poller's own limit.

    python -m bench.fakes.metrics_responder --n 512 --base-port 21000

Every port answers every GET with the same pre-built HTTP/1.1 response: the samples
the router reads, in vLLM's wire format (`bench.fakes.fake_metrics.render`). Against the
emulator fleet (`bench.emulator`), 512 instances in one Python process render and
serve ~1,300 pages a second on this machine, well short of the 5,120 that 512 backends
at a 100 ms interval ask for, so that run measures the emulator. Answering from bytes
built once costs a few µs per request and leaves the poller as the bottleneck
(`make bench STUDY=scale` reports both). Real backends each serve only their own page.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import cast

from bench.fakes.fake_metrics import FakeStats, render
from proxy.fleet.vllm_metrics import WANTED

_END = b"\r\n\r\n"


def page() -> bytes:
    stats = FakeStats()
    stats.running, stats.waiting, stats.kv_tokens = 12, 3, 40_000
    for seconds in (0.05, 0.12, 0.3):
        stats.ttft.observe(seconds)
        stats.itl.observe(seconds / 10)
    body = render(stats, "meta-llama/Llama-3.1-8B-Instruct", 100_000, frozenset(WANTED))
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


class _Answer(asyncio.Protocol):
    """One copy of `response` per request head received (GETs carry no body)."""

    def __init__(self, response: bytes) -> None:
        self._response = response
        self._pending = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._pending += data
        requests = self._pending.count(_END)
        if requests and self._transport is not None:
            self._pending = self._pending[self._pending.rfind(_END) + len(_END):]
            self._transport.write(self._response * requests)


async def serve(n: int, base_port: int) -> None:
    loop = asyncio.get_running_loop()
    response = page()
    servers = [await loop.create_server(lambda: _Answer(response), "127.0.0.1", base_port + i,
                                        backlog=64) for i in range(n)]
    print(f"{n} static /metrics endpoints on ports {base_port}..{base_port + n - 1}",
          flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--base-port", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        import uvloop
        uvloop.run(serve(args.n, args.base_port))
    except ImportError:
        asyncio.run(serve(args.n, args.base_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
