"""A proxy in front of real vLLM-CPU servers started with `--enable-force-include-usage`:
they put usage in every chunk of every stream, and end it with a usage event, whether
the client asked or not. A tracked stream's events are the proxy's own, so it must do
the same (before, they carried no usage and the usage event came only when asked),
also across a move. Compared as tests/integration/test_fidelity_vllm.py compares."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from bench.harness.ports import free_port
from bench.harness.proxy_process import running_proxy
from bench.models.backends import Running, Spec, fleet
from tests.integration.test_fidelity_vllm import (
    MODEL,
    answered_until_counted,
    assert_same,
    chat,
    completion,
    summary,
)

pytestmark = pytest.mark.vllm

CASES = {
    "chat": chat(max_tokens=8),
    "chat-usage-asked": chat(max_tokens=8, stream_options={"include_usage": True}),
    "chat-token-ids": chat(max_tokens=8, return_token_ids=True),
    "completion": completion(max_tokens=8),
}


@pytest.fixture(scope="module")
def forced() -> Iterator[list[Running]]:
    specs = [Spec(f"usage-{i}", "small", MODEL, free_port(),
                  extra_args=("--enable-force-include-usage",)) for i in range(2)]
    with fleet(specs, timeout_s=240) as servers:  # under pytest's 300 s per test
        yield servers


@pytest.fixture(scope="module")
def proxy_url(forced: list[Running]) -> Iterator[str]:
    config = {"backends": [{"name": b.name, "url": b.url, "model": b.model} for b in forced],
              "policy": {"name": "round_robin"},
              "migration": {"warm_prefill": False, "pace_slowdown": 0},
              "debug": {"allow_forced_migration": True}}
    with running_proxy(config) as proxy:
        yield proxy.url


@pytest.mark.parametrize("moved", [False, True], ids=["stays", "moved"])
@pytest.mark.parametrize("case", list(CASES))
def test_usage_is_in_every_chunk_as_the_server_puts_it(
        forced: list[Running], proxy_url: str, case: str, moved: bool) -> None:
    path, body = CASES[case]
    body: dict[str, Any] = {**body, "stream": True}
    want = summary(httpx.post(forced[0].url + path, json=body, timeout=60), True)
    assert want["per_chunk_usage"] and want["usage"]  # what the flag does
    answered_until_counted(proxy_url, path, body, moved, moved,
                           lambda got: _check(got, want))


def _check(got: httpx.Response, want: dict[str, Any]) -> None:
    assert_same(summary(got, True), want)
    # Each chunk counts the tokens so far (vLLM packs them into events differently
    # from run to run, so the counts are compared, not the events).
    counts = [event["usage"]["completion_tokens"] for event in _events(got.text)
              if event.get("choices")]
    assert counts == sorted(counts) and counts[-1] == want["usage"][0]["completion_tokens"]


def _events(text: str) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in text.split("\n")
            if line.startswith("data: {")]
