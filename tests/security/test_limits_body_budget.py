"""Second review, residual 7: no bound on the request bodies the proxy holds at once.
`server.max_body_bytes_in_flight` bounds them across every connection: a request whose
body would go past it gets an OpenAI-shaped 503 before its body is read, and the
budget comes back when a request ends (its connection closed) or is answered."""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pytest

from bench.harness.proxy_process import ProxyProcess, running_proxy
from tests.security.input_helpers import (
    connect,
    error_of,
    fake_url,
    proxy_config,
    read_answer,
    status_of,
)

__all__ = ["fake_url"]
BUDGET = 100_000


@pytest.fixture(scope="module")
def proxy(fake_url: str) -> Iterator[ProxyProcess]:
    with running_proxy(proxy_config(
            fake_url, server={"max_body_bytes_in_flight": BUDGET})) as proxy:
        yield proxy


def chat_of(size: int) -> bytes:
    """A valid chat request of exactly `size` bytes."""
    body = orjson.dumps({"model": "fake", "max_tokens": 1,
                         "messages": [{"role": "user", "content": ""}]})
    return body.replace(b'"content":""', b'"content":"' + b"x" * (size - len(body)) + b'"')


def head_of(size: int) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
            b"application/json\r\ncontent-length: %d\r\n\r\n" % size)


def test_bodies_past_the_budget_get_503_until_one_ends(proxy: ProxyProcess) -> None:
    body = chat_of(60_000)
    holder = connect(proxy.url)
    holder.sendall(head_of(len(body)) + body[:1000])  # holds 60 kB while it trickles
    with connect(proxy.url) as second:
        second.sendall(head_of(len(body)))
        answer = read_answer(second)
    assert status_of(answer) == 503
    assert error_of(answer)["code"] == "overloaded"
    assert b"retry-after: 1" in answer.lower()
    holder.close()  # its request ends: the budget comes back
    for _ in range(50):  # (the proxy sees the close at its next read)
        with connect(proxy.url) as third:
            third.sendall(head_of(len(body)) + body)
            answer = read_answer(third)
        if status_of(answer) != 503:
            break
    assert status_of(answer) == 200, answer[:300]


def test_requests_within_the_budget_are_served_one_after_another(proxy: ProxyProcess) -> None:
    body = chat_of(60_000)
    for _ in range(3):  # each one's share is returned when it is answered
        with connect(proxy.url) as sock:
            sock.sendall(head_of(len(body)) + body)
            assert status_of(read_answer(sock)) == 200
