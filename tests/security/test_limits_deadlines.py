"""Item 5: a trickling client cannot keep a connection past its deadlines: the whole
request (headers and body) within `server.request_timeout_s`, and an idle connection
within `server.keep_alive_s` however it trickles bytes that begin no request."""

from __future__ import annotations

import time
from collections.abc import Iterator

import orjson
import pytest

from bench.harness.proxy_process import ProxyProcess, running_proxy
from tests.security.input_helpers import (
    CHAT,
    closed_by_server,
    connect,
    error_of,
    fake_url,
    proxy_config,
    read_answer,
    status_of,
)

__all__ = ["fake_url"]
LIMITS = {"header_timeout_s": 1.0, "request_timeout_s": 2.0, "body_timeout_s": 30.0,
          "keep_alive_s": 1}
TRICKLE_S = 8.0  # how long the client trickles: 4x the longest deadline


@pytest.fixture(scope="module")
def proxy(fake_url: str) -> Iterator[ProxyProcess]:
    with running_proxy(proxy_config(fake_url, server=LIMITS)) as proxy:
        yield proxy


def test_a_body_trickled_after_a_fast_answer_is_cut(proxy: ProxyProcess) -> None:
    # GET /v1/models is answered without reading the body; the client then trickles it
    with connect(proxy.url) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n")
        assert status_of(read_answer(sock)) == 200
        assert closed_by_server(sock, TRICKLE_S, trickle=b"a")


def test_blank_lines_do_not_extend_an_idle_connection(proxy: ProxyProcess) -> None:
    with connect(proxy.url) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        assert status_of(read_answer(sock)) == 200
        assert closed_by_server(sock, TRICKLE_S, trickle=b"\r\n")


def test_a_trickled_request_body_gets_408(proxy: ProxyProcess) -> None:
    # body_timeout_s (30 s) is longer: the whole-request deadline (2 s) cuts it
    body = orjson.dumps(CHAT)
    with connect(proxy.url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
        started = time.monotonic()
        answer = b""
        for byte in body[:-1]:
            try:
                sock.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.3)
            if time.monotonic() - started > TRICKLE_S:
                break
            sock.setblocking(False)
            try:
                answer += sock.recv(65536)
            except BlockingIOError:
                pass
            sock.setblocking(True)
            if answer:
                break
        answer += read_answer(sock, timeout_s=2)
    assert status_of(answer) == 408
    assert error_of(answer)["code"] == "request_timeout"


def test_trickled_headers_get_408(proxy: ProxyProcess) -> None:
    with connect(proxy.url) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
        assert not closed_by_server(sock, 0.3)
        closed = closed_by_server(sock, TRICKLE_S, trickle=b"x-a: b\r\n")
    assert closed
