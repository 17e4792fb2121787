"""Second review of #71: with auth on, a request without a valid key is refused from
its headers, before its body is read. The body was read (up to server.max_body_bytes,
for up to server.body_timeout_s) and parsed first: parsing a 4 MiB JSON body of small
objects costs ~24x its size in memory and the event loop's time, which any stranger
could make the proxy spend. Against a real `laneway serve`, with raw sockets (a body
announced and never sent)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.harness.proxy_process import ProxyProcess, running_proxy
from proxy.hashing import hash_key
from tests.security.input_helpers import connect, fake_vllm, proxy_config, read_answer, status_of


@pytest.fixture(scope="module")
def proxy() -> Iterator[ProxyProcess]:
    with fake_vllm() as url:
        config = proxy_config(url, auth={"enabled": True, "keys": [
            {"name": "k", "sha256": hash_key("sk-the-only-key")}]})
        with running_proxy(config) as proxy:
            yield proxy


@pytest.mark.parametrize(("path", "credentials"), [
    ("/v1/chat/completions", b""),
    ("/v1/completions", b"Authorization: Bearer sk-wrong\r\n"),
    ("/v1/messages", b"x-api-key: sk-wrong\r\n"),
    ("/v1/embeddings", b""),
    ("/v1/audio/transcriptions", b"Authorization: Bearer sk-wrong\r\n"),
])
def test_no_valid_key_is_refused_before_the_body(proxy: ProxyProcess, path: str,
                                                 credentials: bytes) -> None:
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/json\r\nContent-Length: 4000000\r\n").encode()
    with connect(proxy.url) as sock:
        sock.sendall(head + credentials + b"\r\n")  # and not a byte of the body
        answer = read_answer(sock, timeout_s=10)
    assert status_of(answer) == 401, answer[:300]


def test_a_valid_key_still_gets_its_answer(proxy: ProxyProcess) -> None:
    body = b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}]}'
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Authorization: Bearer sk-the-only-key\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    with connect(proxy.url) as sock:
        sock.sendall(request)
        assert status_of(read_answer(sock)) == 200
