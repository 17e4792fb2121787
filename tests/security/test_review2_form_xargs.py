"""Second review of #71: a form upload's `vllm_xargs` loses its `laneway_` keys as a
JSON body's does. vLLM's audio routes read the field with `json.loads` and hand it to
the engine as `extra_args`, where the laneway_slice scheduler plugin takes the request's
SLO class and utility from `laneway_*` keys: a tenant could raise its own. Against a
real `laneway serve` and a backend that keeps the bytes it was sent."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from bench.harness.proxy_process import ProxyProcess, running_proxy
from tests.security.input_helpers import Answer, FakeBackend, proxy_config

PATH = "/v1/audio/transcriptions"


class _Backend(FakeBackend):
    """Answers every POST with a transcription and keeps the bodies it was sent."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        super().__init__()

    def post(self, path: str, headers: dict[str, str], body: bytes) -> Answer:
        self.bodies.append(body)
        return 200, {}, b'{"text":"ok"}'


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ProxyProcess, _Backend]]:
    backend = _Backend()
    try:
        with running_proxy(proxy_config(backend.url)) as proxy:
            yield proxy, backend
    finally:
        backend.close()


def _upload(proxy: ProxyProcess, *fields: tuple[str, bytes]) -> httpx.Response:
    parts = [(b'form-data; name="file"; filename="a.wav"', b"RIFF...."),
             (b'form-data; name="model"', b"fake")]
    parts += [(f'form-data; name="{name}"'.encode(), value) for name, value in fields]
    body = b"".join(b"--BND\r\nContent-Disposition: " + d + b"\r\n\r\n" + v + b"\r\n"
                    for d, v in parts) + b"--BND--\r\n"
    return httpx.post(proxy.url + PATH, content=body, timeout=10,
                      headers={"content-type": "multipart/form-data; boundary=BND"})


def _xargs_sent(body: bytes) -> object:
    """The `vllm_xargs` field of a form the backend received, read as vLLM reads it."""
    part = body.split(b'name="vllm_xargs"\r\n\r\n', 1)[1]
    return json.loads(part.split(b"\r\n--BND", 1)[0])


def test_laneway_xargs_of_a_form_upload_do_not_reach_the_backend(
        served: tuple[ProxyProcess, _Backend]) -> None:
    proxy, backend = served
    sent = (b'{"laneway_slo_class": "realtime", "\\u006caneway_utility": 1e9, '
            b'"keep": 1}')  # (an escaped name is the same key to json.loads)
    answer = _upload(proxy, ("vllm_xargs", sent))
    assert answer.status_code == 200, answer.text
    assert _xargs_sent(backend.bodies[-1]) == {"keep": 1}


def test_other_xargs_of_a_form_upload_pass_untouched(
        served: tuple[ProxyProcess, _Backend]) -> None:
    proxy, backend = served
    assert _upload(proxy, ("vllm_xargs", b'{"keep": 1}')).status_code == 200
    assert b'name="vllm_xargs"\r\n\r\n{"keep": 1}\r\n' in backend.bodies[-1]


def test_two_xargs_fields_are_refused(served: tuple[ProxyProcess, _Backend]) -> None:
    # the backend reads the last: the proxy must not check one and send the other
    proxy, backend = served
    sent = len(backend.bodies)
    answer = _upload(proxy, ("vllm_xargs", b"{}"),
                     ("vllm_xargs", b'{"laneway_slo_class": "realtime"}'))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "vllm_xargs"
    assert len(backend.bodies) == sent
