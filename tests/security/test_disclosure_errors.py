"""#71 part A, findings 12 and 14: what a client learns of the fleet. `/health` says
only whether the proxy is ready; errors do not relay a backend's text or an address;
reading a stored response is charged and checked against the key's models before any
backend is asked. Against a real `laneway serve`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from bench.fakes.fake_vllm import FakeConfig, RunningFake
from bench.harness.proxy_process import running_proxy
from proxy.hashing import hash_key
from tests.security.admin_helpers import CHAT, TOKEN, admin, backends, fakes_in_thread


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def fakes() -> Iterator[list[RunningFake]]:
    with fakes_in_thread(FakeConfig(), FakeConfig(model="b")) as running:
        yield running


def test_health_tells_a_client_the_status_only(fakes: list[RunningFake]) -> None:
    auth = {"enabled": True, "keys": [{"name": "k", "sha256": hash_key("sk-k")}]}
    with running_proxy({"backends": backends(fakes), "auth": auth,
                        "admin": {"token": TOKEN}}) as proxy:
        health = httpx.get(f"{proxy.url}/health", timeout=10)
        details = admin(proxy.url, "GET", "health")
        anonymous_details = admin(proxy.url, "GET", "health", headers={})
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    for secret in (fakes[0].url, "127.0.0.1", '"b"', "f0"):
        assert secret not in health.text
    assert details.status_code == 200  # the operator's view
    assert details.json()["backends"]["f0"]["url"] == fakes[0].url
    assert anonymous_details.status_code == 401


def test_a_backends_error_text_and_address_stay_in_the_log() -> None:
    with fakes_in_thread(FakeConfig(fail_status=500)) as failing:
        dead = {"name": "dead", "url": "http://127.0.0.1:9", "model": "fake"}
        config = {"backends": [*backends(failing), dead],
                  "upstream": {"max_attempts": 2}, "outliers": {"failures": 0}}
        with running_proxy(config) as proxy:
            answers = [httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, timeout=10)
                       for _ in range(4)]
    failed = [a for a in answers if a.status_code >= 500]
    assert failed, [a.status_code for a in answers]
    for answer in failed:
        assert answer.json()["error"]["type"] in ("upstream_error", "service_unavailable")
        assert "injected failure" not in answer.text  # the backend's own words
        assert "127.0.0.1" not in answer.text and failing[0].url not in answer.text


def test_a_mid_stream_failure_reports_its_kind_not_the_exception() -> None:
    with fakes_in_thread(FakeConfig(die_after_tokens=2)) as dying, running_proxy(
            {"backends": backends(dying), "migration": {"enabled": False}}) as proxy:
        streamed = httpx.post(f"{proxy.url}/v1/chat/completions", timeout=10,
                              json={**CHAT, "stream": True, "max_tokens": 8})
    events = [line.removeprefix("data: ") for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    errors = [orjson.loads(e)["error"] for e in events if '"error"' in e]
    assert errors == [{"message": "Backend f0 failed mid-stream (broken); the response "
                                  "is incomplete.", "type": "upstream_error", "param": None,
                       "code": "upstream_failed"}]


def test_a_stored_response_is_looked_up_only_after_the_keys_check(
        fakes: list[RunningFake]) -> None:
    """bob may use model b only: the backend of model `fake` is never asked for him, so
    he cannot learn that a response of `fake` exists; and each read is charged."""
    keys = [{"name": "alice", "sha256": hash_key("sk-alice"), "models": ["fake"]},
            {"name": "bob", "sha256": hash_key("sk-bob"), "models": ["b"],
             "requests_per_minute": 2}]
    config: dict[str, Any] = {"backends": backends(fakes),
                              "auth": {"enabled": True, "keys": keys}}
    with running_proxy(config) as proxy:
        made = httpx.post(f"{proxy.url}/v1/responses", headers=bearer("sk-alice"),
                          json={"model": "fake", "input": "hi", "max_output_tokens": 2},
                          timeout=10).json()
        # a restart forgets the homes: this proxy must look the id up again
        with running_proxy(config) as fresh:
            reads = [httpx.get(f"{fresh.url}/v1/responses/{made['id']}", timeout=10,
                               headers=bearer("sk-bob")) for _ in range(3)]
            alices = httpx.get(f"{fresh.url}/v1/responses/{made['id']}", timeout=10,
                               headers=bearer("sk-alice"))
    assert [r.status_code for r in reads] == [404, 404, 429]  # not 403: not disclosed
    assert alices.status_code == 200 and alices.json()["id"] == made["id"]


def test_the_acl_is_on_the_responses_model_not_the_backends(
        fakes: list[RunningFake]) -> None:
    """A backend of base model `fake` serving an adapter `fake-lora`: a key for `fake`
    only may not read what `fake-lora` made there."""
    with fakes_in_thread(FakeConfig(aliases=("fake-lora",))) as lora:
        keys = [{"name": "dave", "sha256": hash_key("sk-dave"), "models": ["fake-lora"]},
                {"name": "carol", "sha256": hash_key("sk-carol"), "models": ["fake"]}]
        config = {"backends": backends(lora), "auth": {"enabled": True, "keys": keys},
                  "poller": {"models_interval_s": 0.2}}
        with running_proxy(config) as proxy:
            made = _respond_when_routable(proxy.url, "sk-dave", "fake-lora")
            carols = httpx.get(f"{proxy.url}/v1/responses/{made['id']}", timeout=10,
                               headers=bearer("sk-carol"))
            daves = httpx.get(f"{proxy.url}/v1/responses/{made['id']}", timeout=10,
                              headers=bearer("sk-dave"))
    assert made["model"] == "fake-lora"
    assert carols.status_code == 403 and carols.json()["error"]["param"] == "model"
    assert daves.status_code == 200


def _respond_when_routable(url: str, key: str, model: str) -> dict[str, Any]:
    answer = None
    for _ in range(50):  # the adapter is routable once /v1/models was read
        answer = httpx.post(f"{url}/v1/responses", headers=bearer(key), timeout=10,
                            json={"model": model, "input": "hi", "max_output_tokens": 2})
        if answer.status_code == 200:
            break
        time.sleep(0.1)
    assert answer is not None and answer.status_code == 200, answer and answer.text
    data: dict[str, Any] = answer.json()
    return data

