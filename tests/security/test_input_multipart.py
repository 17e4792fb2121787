"""Item 7: a form upload's `model` is read as the backend (FastAPI) reads it, and a
form the two could read differently is refused: a key allowed model A cannot be served
model B by naming both."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from bench.harness.proxy_process import ProxyProcess, running_proxy
from proxy.admission.auth import hash_key
from tests.security.input_helpers import fake_vllm, proxy_config

PATH = "/v1/audio/transcriptions"
KEY = "sk-only-a"


@pytest.fixture(scope="module")
def proxy() -> Iterator[ProxyProcess]:
    # one backend serving "a" and "b"; the key may use "a" only
    with fake_vllm("--model", "a", "--alias", "b") as url:
        config = proxy_config(url, model="a", auth={
            "enabled": True, "keys": [{"name": "k", "sha256": hash_key(KEY),
                                       "models": ["a"]}]})
        config["backends"].append({"name": "b1", "url": url, "model": "b"})
        with running_proxy(config) as proxy:
            yield proxy


def _upload(proxy: ProxyProcess, *dispositions: tuple[str, bytes]) -> httpx.Response:
    parts = [(b'form-data; name="file"; filename="a.wav"', b"RIFF....")]
    parts += [(d.encode(), v) for d, v in dispositions]
    body = b"".join(b"--BND\r\nContent-Disposition: " + d + b"\r\n\r\n" + v + b"\r\n"
                    for d, v in parts) + b"--BND--\r\n"
    return httpx.post(proxy.url + PATH, content=body, timeout=10, headers={
        "authorization": f"Bearer {KEY}",
        "content-type": "multipart/form-data; boundary=BND"})


def test_two_model_fields_are_refused(proxy: ProxyProcess) -> None:
    answer = _upload(proxy, ('form-data; name="model"', b"a"),
                     ('form-data; name="model"', b"b"))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "model"


def test_an_unquoted_second_model_field_is_refused(proxy: ProxyProcess) -> None:
    answer = _upload(proxy, ('form-data; name="model"', b"a"), ("form-data; name=model", b"b"))
    assert answer.status_code == 400, answer.text


def test_an_unquoted_model_field_is_the_model(proxy: ProxyProcess) -> None:
    # the backend reads `name=model` unquoted: so does the proxy (and checks the key)
    assert _upload(proxy, ("form-data; name=model", b"b")).status_code == 403
    answer = _upload(proxy, ("form-data; name=model", b"a"))
    assert answer.status_code == 200, answer.text
    assert answer.json()["text"].startswith("a heard")


def test_a_disposition_naming_twice_is_refused(proxy: ProxyProcess) -> None:
    answer = _upload(proxy, ('form-data; name="x"; name="model"', b"b"),
                     ('form-data; name="model"', b"a"))
    assert answer.status_code == 400, answer.text
