"""Shared parts of the input-bound tests: a fake vLLM in its own process, a recording
backend, a config for `laneway serve` in front of them, and a raw socket client (for
requests an HTTP client would refuse to send, or answers it would not leave unread)."""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from bench.harness.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


@contextlib.contextmanager
def fake_vllm(*args: str) -> Iterator[str]:
    """`python -m bench.fakes.fake_vllm` (model `fake`) on a free port; its URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.fakes.fake_vllm", "--port", str(port),
                             *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fake vLLM did not start")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with fake_vllm() as url:
        yield url


def proxy_config(backend_url: str, model: str = "fake", **sections: Any) -> dict[str, Any]:
    """A config for one backend; `sections` add to it (`server` merged)."""
    return {"backends": [{"name": "b0", "url": backend_url, "model": model}],
            "poller": {"interval_s": 0.2}, **sections}


Answer = tuple[int, dict[str, str], bytes]  # status, headers beyond the defaults, body
CHAT_COMPLETION = json.dumps({
    "id": "x", "object": "chat.completion", "model": "fake", "choices": [
        {"index": 0, "finish_reason": "stop",
         "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()


class FakeBackend:
    """A backend on a thread of the test process: it answers what the poller reads
    (GET /v1/models, /metrics) and every POST with `post`'s answer, so a test can keep
    what the proxy forwards and answer as it needs."""

    def __init__(self) -> None:
        backend = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self._answer((200, {}, b'{"object":"list","data":[{"id":"fake","object":"model"}]}'
                              if self.path.startswith("/v1/models")
                              else b"vllm:num_requests_running 0\n"))

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                self._answer(backend.post(self.path, headers, raw))

            def _answer(self, answer: Answer) -> None:
                status, headers, body = answer
                self.send_response(status)
                for name, value in {"content-type": "application/json", **headers,
                                    "content-length": str(len(body))}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def post(self, path: str, headers: dict[str, str], body: bytes) -> Answer:
        return 200, {}, CHAT_COMPLETION

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Recorder(FakeBackend):
    """Answers every POST with a small chat completion and keeps what it received
    (headers and JSON body), to see what the proxy forwards."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, str], Any]] = []
        super().__init__()

    def post(self, path: str, headers: dict[str, str], body: bytes) -> Answer:
        self.requests.append((headers, json.loads(body)))
        return super().post(path, headers, body)


def connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    """A TCP connection to `url`'s host and port (`rcvbuf`: a small receive buffer, set
    before connecting, for a client that reads nothing)."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect((parts.hostname or "127.0.0.1", parts.port or 80))
    return sock


def read_answer(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    """What the server sends until it closes (or `timeout_s` passes, or one whole
    answer with a content-length came)."""
    sock.settimeout(timeout_s)
    data = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            if sep and length and len(body) >= int(length.group(1)):
                break
    return data


def raw_exchange(url: str, request: bytes, timeout_s: float = 10.0) -> bytes:
    """Send `request` as is on a new connection; the answer's bytes."""
    with connect(url) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(request)
        return read_answer(sock, timeout_s)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def error_of(answer: bytes) -> dict[str, Any]:
    """The OpenAI-shaped error an answer carries (it must be JSON of that shape)."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), answer[:300]
    error = json.loads(body)["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    return dict(error)


def closed_by_server(sock: socket.socket, within_s: float, trickle: bytes = b"",
                     every_s: float = 0.3) -> bool:
    """Whether the server closes `sock` within `within_s` while the client sends
    `trickle` every `every_s` (what it answers meanwhile is read and dropped)."""
    sock.setblocking(False)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if trickle:
                sock.send(trickle)
            while True:
                if not sock.recv(65536):
                    return True
        except BlockingIOError:
            pass
        except (BrokenPipeError, ConnectionResetError):
            return True
        time.sleep(every_s)
    return False


def gauge(url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples on the proxy's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))
