"""Second review of #71: the relay does not follow a backend's redirect. Followed, a
backend (an admin-added one the allow-list admits, or a compromised one) could send
the proxy, with the client's prompt, to any host (cloud metadata, a local service)
and have that host's answer relayed to the client: around admin.backend_allowlist.
Against a real `laneway serve`."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from bench.harness.proxy_process import running_proxy
from tests.security.input_helpers import CHAT, Answer, FakeBackend, proxy_config


class _Listener(FakeBackend):
    """A local HTTP server that answers every POST with a redirect to `location` when
    given, else with a chat completion; it keeps the paths it was sent."""

    def __init__(self, location: str | None = None) -> None:
        self.posts: list[str] = []
        self._location = location
        super().__init__()

    def post(self, path: str, headers: dict[str, str], body: bytes) -> Answer:
        self.posts.append(path)
        if self._location is not None:
            return 307, {"location": self._location + path}, b""
        return 200, {}, json.dumps({
            "id": "elsewhere", "object": "chat.completion", "model": "fake",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {
                "role": "assistant", "content": "from the redirect target"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                      "total_tokens": 2}}).encode()


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
