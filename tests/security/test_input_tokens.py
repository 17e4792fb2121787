"""Item 13: token limits charge what a request may really generate: every one of its
`n` / `best_of` completions, and for a request without max_tokens what its model could
generate (within the key's limit); two keys may not share a name (and so limits)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from bench.harness.proxy_process import ProxyProcess, running_proxy
from proxy.admission.auth import hash_key
from tests.security.input_helpers import CHAT, fake_url, proxy_config

__all__ = ["fake_url"]
KEY = "sk-tpm"
TPM = 1000


@pytest.fixture(scope="module")
def proxy(fake_url: str) -> Iterator[ProxyProcess]:
    auth = {"enabled": True, "keys": [{"name": "k", "sha256": hash_key(KEY),
                                       "tokens_per_minute": TPM}]}
    with running_proxy(proxy_config(fake_url, auth=auth)) as proxy:
        yield proxy


def _chat(proxy: ProxyProcess, **fields: object) -> httpx.Response:
    return httpx.post(proxy.url + "/v1/chat/completions", json={**CHAT, **fields},
                      headers={"authorization": f"Bearer {KEY}"}, timeout=10)


def test_n_completions_are_charged_n_times(proxy: ProxyProcess) -> None:
    # 20 x 100 tokens cannot fit a 1000-token minute: refused up front
    answer = _chat(proxy, max_tokens=100, n=20)
    assert answer.status_code == 429, answer.text
    assert answer.json()["error"]["type"] == "tokens"
    answer = _chat(proxy, max_tokens=10, best_of=200)
    assert answer.status_code == 429, answer.text


def test_a_request_without_max_tokens_reserves_what_the_model_could_generate(
        proxy: ProxyProcess) -> None:
    # the fake's context is 4096 tokens: more than the key's minute, so the request
    # holds the whole minute while it runs (256 before: concurrent ones overshot)
    answer = _chat(proxy)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-ratelimit-remaining-tokens"] == "0"


def test_two_keys_of_one_name_are_a_config_error(fake_url: str) -> None:
    auth = {"enabled": True, "keys": [{"name": "same", "sha256": hash_key("sk-1")},
                                      {"name": "same", "sha256": hash_key("sk-2")}]}
    with pytest.raises(RuntimeError, match="duplicate API key names"), \
            running_proxy(proxy_config(fake_url, auth=auth), ready_timeout_s=15):
        pass
