"""ELDR PD mode with `kv_transfer`: the prefill leg's KV handle reaches the first decode
request, and nothing else (not the client, not a migration, not a retry that may find
the blocks gone)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import uvicorn

from bench.fakes.fake_vllm import FakeConfig, FakeVllm
from predictors.eldr.experts import SignatureSpec, normalize
from predictors.eldr.fit import EldrModel, save
from proxy.asgi import Receive, Scope, Send, header_map, read_body, send_json
from proxy.http.server import RunningProxy, uvicorn_in_loop
from proxy.routing.kv_transfer import REMOTE_DECODE
from tests.proxy.fakes import CHAT, events, fleet, post

# What a prefill vLLM with NixlConnector answers (pull_scheduler.request_finished).
HANDLE = {"do_remote_prefill": True, "do_remote_decode": False,
          "remote_block_ids": [[7, 8, 9]], "remote_engine_id": "p0-engine",
          "remote_request_id": "cmpl-lw-1-0", "remote_host": "10.0.0.5",
          "remote_port": 5600, "tp_size": 1}
COMPLETION = {"model": "fake", "prompt": "one two three", "max_tokens": 4}


class KvConnectorFake:
    """A vLLM with a KV connector, as far as the proxy sees one: every generation
    request gets a whole response whose top-level `kv_transfer_params` is `returns`;
    /metrics and /health come from the plain fake, so the poller finds it healthy."""

    def __init__(self, returns: dict[str, Any] | None) -> None:
        self.returns = returns
        self.bodies: list[dict[str, Any]] = []
        self._plain = FakeVllm(FakeConfig())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("completions"):
            await self._plain(scope, receive, send)
            return
        body = orjson.loads(await read_body(header_map(scope), receive, 1 << 20))
        self.bodies.append(body)
        await send_json(send, 200, {
            "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "fake",
            "choices": [{"index": 0, "text": "tok0 ", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            "kv_transfer_params": self.returns})


@contextlib.asynccontextmanager
async def serving(app: KvConnectorFake) -> AsyncIterator[str]:
    async with uvicorn_in_loop(uvicorn.Config(
            app, host="127.0.0.1", port=0, loop="none", http="httptools",
            lifespan="off", access_log=False, log_config=None)) as url:
        yield url


@contextlib.asynccontextmanager
async def pd_fleet(tmp_path: Path, *decoders: FakeConfig, kv_transfer: bool = True,
                   extra_decoders: tuple[dict[str, Any], ...] = (), **sections: Any
                   ) -> AsyncIterator[tuple[RunningProxy, KvConnectorFake, list[Any]]]:
    """laneway with eldr in PD mode: one prefill backend (`p0`) that returns HANDLE,
    decoders f0, f1, ... (no signature: no side endpoint, so they balance load)."""
    model = EldrModel(SignatureSpec(np.ones((1, 2)), (0,)), normalize(np.eye(2)),
                      ("f0", "f1"))
    save(model, {}, tmp_path / "eldr")
    prefill = KvConnectorFake(HANDLE)
    params = {"artifact": str(tmp_path / "eldr"), "pd": True, "kv_transfer": kv_transfer}
    async with serving(prefill) as url:
        extra = [{"name": "p0", "url": url, "model": "fake", "labels": {"role": "prefill"}},
                 *extra_decoders]
        async with fleet(*decoders, extra_backends=extra,
                         policy={"name": "eldr", "params": params}, **sections
                         ) as (proxy, fakes):
            yield proxy, prefill, fakes


def kv_of(fake: Any) -> list[Any]:
    """The `kv_transfer_params` of every request a fake received (None: absent)."""
    return [body.get("kv_transfer_params") for body in fake.app.stats.bodies]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("kv_transfer", [True, False], ids=["kv", "no-kv"])
async def test_the_decode_request_carries_exactly_the_handle_the_prefill_returned(
        tmp_path: Path, stream: bool, kv_transfer: bool) -> None:
    async with pd_fleet(tmp_path, FakeConfig(), FakeConfig(),
                        kv_transfer=kv_transfer) as (proxy, prefill, fakes):
        response = await post(proxy, {**CHAT, "max_tokens": 5, "stream": stream})
    assert response.status_code == 200
    (leg,) = prefill.bodies
    assert leg["max_tokens"] == 1 and leg["stream"] is False
    assert leg.get("kv_transfer_params") == (dict(REMOTE_DECODE) if kv_transfer else None)
    served = next(f for f in fakes if f.app.stats.bodies)
    assert response.headers["x-laneway-backend"] == ("f0" if served is fakes[0] else "f1")
    assert kv_of(served) == [HANDLE if kv_transfer else None]
    assert "p0-engine" not in response.text  # the client never sees the handle
    if stream:
        assert events(response.text)[-1] == "[DONE]"
    else:
        assert response.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3 tok4 "


async def test_a_handle_in_the_decode_response_is_not_shown_to_the_client(
        tmp_path: Path) -> None:
    """In vLLM's bidirectional mode the decode server returns a handle of its own; a
    plain relay (here: migration off) nulls it."""
    decoder = KvConnectorFake({**HANDLE, "remote_engine_id": "d0-engine"})
    async with serving(decoder) as url:
        d0 = {"name": "d0", "url": url, "model": "fake"}
        async with pd_fleet(tmp_path, extra_decoders=(d0,),
                            migration={"enabled": False}) as (proxy, _, _):
            response = await post(proxy, COMPLETION, "/v1/completions")
    assert response.status_code == 200
    assert [b["kv_transfer_params"] for b in decoder.bodies] == [HANDLE]
    assert response.json()["kv_transfer_params"] is None
    assert response.json()["choices"][0]["text"] == "tok0 "
    assert response.headers["content-length"] == str(len(response.content))


async def test_a_migrated_continuation_does_not_carry_the_handle(tmp_path: Path) -> None:
    async with pd_fleet(tmp_path, FakeConfig(), FakeConfig(),
                        debug={"allow_forced_migration": True}) as (proxy, _, fakes):
        response = await post(proxy, {**CHAT, "stream": True, "max_tokens": 8},
                              headers={"x-laneway-migrate-after": "3",
                                       "x-laneway-events": "1"})
    assert response.status_code == 200
    source = fakes[0] if response.headers["x-laneway-backend"] == "f0" else fakes[1]
    target = fakes[1] if source is fakes[0] else fakes[0]
    assert kv_of(source) == [HANDLE]
    assert target.app.stats.bodies, "the request did not move"
    assert all(isinstance(b["prompt"], list) for b in target.app.stats.bodies)
    assert kv_of(target) == [None] * len(target.app.stats.bodies)


async def test_a_retry_carries_the_handle_only_after_a_connect_failure(
        tmp_path: Path) -> None:
    """A decoder that answered (here 503) may have pulled the blocks, freeing them on
    the prefill backend; one that could not be reached cannot have."""
    async with pd_fleet(tmp_path, FakeConfig(), FakeConfig(fail_status=503)
                        ) as (proxy, _, (healthy, failing)):
        responses = [await post(proxy, COMPLETION, "/v1/completions") for _ in range(2)]
    assert [r.status_code for r in responses] == [200, 200]
    assert kv_of(failing) == [HANDLE]  # tried first by one of the two requests
    assert sorted(kv_of(healthy), key=str) == sorted([HANDLE, None], key=str)

    dead = {"name": "dead", "url": "http://127.0.0.1:9", "model": "fake"}
    async with pd_fleet(tmp_path, FakeConfig(), extra_decoders=(dead,),
                        poller={"interval_s": 30}) as (proxy, _, (healthy,)):
        registry = proxy.app.runtime.registry  # type: ignore[union-attr]
        registry.publish({**registry.stats, "dead": registry.stats["f0"]})
        responses = [await post(proxy, COMPLETION, "/v1/completions") for _ in range(2)]
        tried_dead = not registry.is_healthy("dead")
    assert [r.status_code for r in responses] == [200, 200]
    assert tried_dead and kv_of(healthy) == [HANDLE, HANDLE]
