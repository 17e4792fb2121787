"""Keys stored in Redis by `laneway keys add` admit requests; limits are shared."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from bench.fakes.fake_vllm import FakeConfig
from proxy.cli import main
from tests.proxy.fakes import CHAT, fleet, post


async def test_key_added_to_redis_is_accepted_with_its_models(
        redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert await asyncio.to_thread(main, ["keys", "add", "--redis-url", redis_url, "--name",
                                          "carol", "--models", "fake", "--rpm", "2"]) == 0
    key = capsys.readouterr().out.strip().split()[-1]
    assert key.startswith("sk-lw-")
    state = {"backend": "redis", "redis_url": redis_url}
    auth = {"enabled": True, "redis_keys": True}
    async with fleet(FakeConfig(), FakeConfig(model="other"), auth=auth,
                     state=state) as (proxy, _):
        ok = await post(proxy, CHAT, headers={"authorization": f"Bearer {key}"})
        other = await post(proxy, {**CHAT, "model": "other"},
                           headers={"authorization": f"Bearer {key}"})
        wrong = await post(proxy, CHAT, headers={"authorization": "Bearer sk-lw-nope"})
        await post(proxy, CHAT, headers={"authorization": f"Bearer {key}"})
        limited = await post(proxy, CHAT, headers={"authorization": f"Bearer {key}"})
    assert (ok.status_code, other.status_code, wrong.status_code) == (200, 403, 401)
    assert limited.status_code == 429


async def test_key_added_with_a_class_and_hints_keeps_them(
        redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    import redis.asyncio as aioredis

    from proxy.admission.auth import Auth
    from proxy.config import AuthConfig
    from proxy.hashing import hash_key
    from proxy.state.rate_counters import WindowCounters

    assert await asyncio.to_thread(main, [
        "keys", "add", "--redis-url", redis_url, "--key-prefix", "hinted", "--name", "dave",
        "--slo-class", "batch", "--hints"]) == 0
    key = capsys.readouterr().out.strip().split()[-1]
    client = aioredis.Redis.from_url(redis_url)
    try:
        stored = await client.hgetall("hinted:apikeys")
    finally:
        await client.aclose()
    auth = Auth(AuthConfig(enabled=True, redis_keys=True), WindowCounters())
    auth.set_store_keys({d.decode(): orjson.loads(v) for d, v in stored.items()})
    loaded = auth.key_of({"authorization": f"Bearer {key}"})
    assert loaded is not None and hash_key(key).encode() in stored
    assert (loaded.name, loaded.slo_class, loaded.hints) == ("dave", "batch", True)
