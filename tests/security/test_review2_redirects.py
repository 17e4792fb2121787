"""Second review of #71: the relay does not follow a backend's redirect. Followed, a
backend (an admin-added one the allow-list admits, or a compromised one) could send
the proxy, with the client's prompt, to any host (cloud metadata, a local service)
and have that host's answer relayed to the client: around admin.backend_allowlist.
Against a real `laneway serve`."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from bench.harness.proxy_process import running_proxy
from tests.security.input_helpers import CHAT, proxy_config


class _Listener:
    """A local HTTP server that answers every POST with `status` (a redirect to
    `location` when given), or a chat completion; it keeps the paths it was sent."""

    def __init__(self, location: str | None = None) -> None:
        self.posts: list[str] = []
        listener = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # what the poller reads
                self._answer(200, b'{"object":"list","data":[{"id":"fake"}]}'
                             if self.path.startswith("/v1/models")
                             else b"vllm:num_requests_running 0\n")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                listener.posts.append(self.path)
                if location is not None:
                    self.send_response(307)
                    self.send_header("location", location + self.path)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                self._answer(200, json.dumps({
                    "id": "elsewhere", "object": "chat.completion", "model": "fake",
                    "choices": [{"index": 0, "finish_reason": "stop", "message": {
                        "role": "assistant", "content": "from the redirect target"}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                              "total_tokens": 2}}).encode())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def redirected() -> Iterator[tuple[_Listener, _Listener]]:
    """(a backend that redirects every POST to `target`, the target)."""
    target = _Listener()
    backend = _Listener(location=target.url)
    try:
        yield backend, target
    finally:
        backend.close()
        target.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings"])
def test_a_backends_redirect_is_not_followed(redirected: tuple[_Listener, _Listener],
                                             path: str) -> None:
    backend, target = redirected
    body = CHAT if path.endswith("completions") else {"model": "fake", "input": "hi"}
    with running_proxy(proxy_config(backend.url)) as proxy:
        answer = httpx.post(proxy.url + path, json=body, timeout=10)
    assert backend.posts == [path]
    assert target.posts == []  # the prompt went nowhere the config does not name
    assert "from the redirect target" not in answer.text
