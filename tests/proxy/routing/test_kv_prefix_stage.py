"""proxy/routing/kv_prefix_stage.py: the prompt tokenized by a fake `/tokenize`, hashed
into vLLM's block chain and looked up in a pre-filled exact index; the stage built
from kv_aware's declaration; `backends[].kv_events` validated."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from policies.kv_aware import KvAware, KvAwareParams
from proxy.config import ConfigError, KvEventsConfig, Settings, load_settings
from proxy.fleet.kv_index import KvIndex
from proxy.routing.block_hashes import BlockHasher
from proxy.routing.kv_prefix_stage import CachedPrefixStage
from proxy.routing.stage_builder import stages_for
from proxy.types import Backend, CachedPrefix, ClusterView, Prediction, RequestContext

TOKENS = list(range(100, 180))  # 80 tokens: five full blocks of 16
CFG = KvEventsConfig(endpoint="tcp://10.0.0.1:5557", block_size=16)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class FakeKv:
    def __init__(self, configs: dict[str, KvEventsConfig]) -> None:
        self.index = KvIndex()
        self._configs = configs

    def config_of(self, backend: str) -> KvEventsConfig | None:
        return self._configs.get(backend)


def _fleet(n: int) -> tuple[Backend, ...]:
    return tuple(Backend(f"b{i}", f"http://b{i}:8000", "m", api_key="k" if i else None)
                 for i in range(n))


def _ctx(endpoint: str = "chat") -> RequestContext:
    return RequestContext(request_id="r1", endpoint=endpoint,  # type: ignore[arg-type]
                          model="m", prompt_text="hi", prompt_blocks=(), stream=False,
                          max_tokens=4)


def _view(candidates: tuple[Backend, ...], inflight: dict[str, int] | None = None
          ) -> ClusterView:
    return ClusterView(candidates, {}, inflight or {}, 0.0)


class Tokenizer:
    """A fake vLLM `/tokenize`: records what it was asked, answers TOKENS."""

    def __init__(self, status: int = 200) -> None:
        self.asked: list[tuple[str, dict[str, Any], str | None]] = []
        self.status = status

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.asked.append((str(request.url), json.loads(request.content),
                           request.headers.get("authorization")))
        if self.status != 200:
            return httpx.Response(self.status, json={"error": "no"})
        return httpx.Response(200, json={"tokens": TOKENS, "count": len(TOKENS),
                                         "max_model_len": 2048})


async def _predict(kv: FakeKv, tokenizer: Tokenizer, data: dict[str, Any],
                   candidates: tuple[Backend, ...], endpoint: str = "chat",
                   inflight: dict[str, int] | None = None) -> Prediction:
    stage = CachedPrefixStage(CachedPrefix(0.5), kv, model_on=lambda b, m: f"{m}@{b.name}",
                              transport=httpx.MockTransport(tokenizer))
    try:
        return await stage.predict(_ctx(endpoint), data, Prediction(),
                                   _view(candidates, inflight))
    finally:
        await stage.close()


async def test_each_candidate_gets_the_tokens_its_cache_holds() -> None:
    fleet = _fleet(3)
    kv = FakeKv({"b0": CFG, "b1": CFG})  # b2 has no events
    chain = BlockHasher("sha256", 16).chain(TOKENS)
    kv.index.store("b0", 0, chain[:2])
    kv.index.store("b1", 0, chain[:4])
    kv.index.store("b1", 0, [chain[4] ^ 1])  # not the prompt's fifth block
    tokenizer = Tokenizer()
    pred = await _predict(kv, tokenizer, {**CHAT, "chat_template_kwargs": {"x": 1}}, fleet)
    assert pred.cached_prefix_tokens == {"b0": 32, "b1": 64}
    [(url, body, _)] = tokenizer.asked  # one /tokenize for the request
    assert url == "http://b0:8000/tokenize"
    assert body == {"model": "m@b0", "messages": CHAT["messages"],
                    "chat_template_kwargs": {"x": 1}}
    busy = {"b0": 3, "b1": 1, "b2": 0}  # the least busy followed one tokenizes
    again = await _predict(kv, tokenizer, CHAT, fleet, inflight=busy)
    assert again == pred and tokenizer.asked[-1][0] == "http://b1:8000/tokenize"


async def test_each_hashing_config_gets_its_own_chain() -> None:
    fleet = _fleet(2)
    cbor = KvEventsConfig(endpoint="tcp://10.0.0.2:5557", block_size=32,
                          hash_algo="sha256_cbor", hash_seed="7")
    kv = FakeKv({"b0": CFG, "b1": cbor})
    kv.index.store("b0", 0, BlockHasher("sha256", 16).chain(TOKENS)[:1])
    kv.index.store("b1", 0, BlockHasher("sha256_cbor", 32, "7").chain(TOKENS))
    pred = await _predict(kv, Tokenizer(), CHAT, fleet)
    assert pred.cached_prefix_tokens == {"b0": 16, "b1": 64}


async def test_a_completion_prompt_is_tokenized_with_special_tokens() -> None:
    tokenizer = Tokenizer()
    kv = FakeKv({"b1": CFG})
    await _predict(kv, tokenizer, {"model": "m", "prompt": "hello"}, _fleet(2), "completions")
    [(url, body, auth)] = tokenizer.asked
    assert url == "http://b1:8000/tokenize" and auth == "Bearer k"
    assert body == {"model": "m@b1", "prompt": "hello", "add_special_tokens": True}


async def test_a_prompt_of_token_ids_needs_no_tokenizer() -> None:
    tokenizer = Tokenizer()
    kv = FakeKv({"b0": CFG})
    kv.index.store("b0", 0, BlockHasher("sha256", 16).chain(TOKENS))
    pred = await _predict(kv, tokenizer, {"model": "m", "prompt": TOKENS}, _fleet(1),
                          "completions")
    assert pred.cached_prefix_tokens == {"b0": 80} and tokenizer.asked == []


@pytest.mark.parametrize("status", [500, 404])
async def test_a_failed_tokenize_leaves_the_field_empty(status: int) -> None:
    kv = FakeKv({"b0": CFG})
    kv.index.store("b0", 0, BlockHasher("sha256", 16).chain(TOKENS))
    pred = await _predict(kv, Tokenizer(status), CHAT, _fleet(1))
    assert pred.cached_prefix_tokens is None


async def test_a_slow_tokenize_leaves_the_field_empty() -> None:
    async def hang(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)
    kv = FakeKv({"b0": CFG})
    stage = CachedPrefixStage(CachedPrefix(0.05), kv, transport=httpx.MockTransport(hang))
    pred = await stage.predict(_ctx(), CHAT, Prediction(), _view(_fleet(1)))
    await stage.close()
    assert pred.cached_prefix_tokens is None and stage.failures == 1


async def test_without_followed_candidates_nothing_is_asked() -> None:
    tokenizer = Tokenizer()
    pred = await _predict(FakeKv({}), tokenizer, CHAT, _fleet(2))
    assert pred.cached_prefix_tokens is None and tokenizer.asked == []


async def test_kv_aware_declares_a_stage_the_builder_builds() -> None:
    policy = KvAware(KvAwareParams(tokenize_timeout_s=0.3))
    [stage] = stages_for(policy, kv=FakeKv({}))
    assert isinstance(stage, CachedPrefixStage)
    await stage.close()
    with pytest.raises(TypeError, match="KV events"):
        stages_for(policy)


def validate_settings(data: dict[str, Any]) -> Settings:
    """As the proxy loads its config file (pydantic's errors become a ConfigError)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        json.dump(data, f)  # JSON is YAML
        f.flush()
        return load_settings(f.name)


def _backend(name: str, **kv: Any) -> dict[str, Any]:
    return {"name": name, "url": f"http://{name}:8000", "model": "m", "kv_events": kv}


def test_the_documented_config_shape_loads() -> None:
    settings = Settings.model_validate({"backends": [
        _backend("a", endpoint="tcp://10.0.0.5:5557", replay_endpoint="tcp://10.0.0.5:5558",
                 topic="kv", hash_algo="sha256_cbor", hash_seed="0", block_size=128),
        {"name": "b", "url": "http://b:8000", "model": "m"}]})
    kv = settings.backends[0].kv_events
    assert kv is not None and (kv.block_size, kv.hash_algo, kv.bind) == (128, "sha256_cbor",
                                                                          False)
    assert settings.backends[1].kv_events is None


@pytest.mark.parametrize(("kv", "error"), [
    ({"endpoint": "tcp://*:5557"}, "bind address"),
    ({"endpoint": "tcp://10.0.0.5:5557", "replay_endpoint": "tcp://*:5558"}, "vLLM binds"),
    ({"endpoint": "http://10.0.0.5:5557"}, "endpoint"),
    ({"endpoint": "tcp://10.0.0.5:5557", "hash_algo": "xxhash"}, "hash_algo"),
    ({"endpoint": "tcp://10.0.0.5:5557", "block_size": 0}, "block_size"),
    ({"endpoint": "tcp://10.0.0.5:5557", "seed": "1"}, "seed"),
    ({}, "endpoint"),
])
def test_bad_kv_events_are_rejected_naming_the_key(kv: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        validate_settings({"backends": [_backend("a", **kv)]})


def test_a_bind_endpoint_may_be_bound_by_one_backend_only() -> None:
    ok = _backend("a", endpoint="tcp://*:5557", bind=True)
    assert validate_settings({"backends": [ok]}).backends[0].kv_events is not None
    with pytest.raises(ConfigError, match="bound by two backends"):
        validate_settings({"backends": [ok, _backend("b", endpoint="tcp://*:5557", bind=True)]})


async def test_a_long_prompt_is_hashed_off_the_loop_to_the_same_result(
        monkeypatch: pytest.MonkeyPatch) -> None:
    threaded: list[str] = []
    to_thread = asyncio.to_thread

    async def recording(func: Any, /, *args: Any) -> Any:
        threaded.append(func.__name__)
        return await to_thread(func, *args)

    monkeypatch.setattr(asyncio, "to_thread", recording)
    long = list(range(16 * 300))  # past INLINE_BLOCKS
    kv = FakeKv({"b0": CFG})
    kv.index.store("b0", 0, BlockHasher("sha256", 16).chain(long)[:299])
    pred = await _predict(kv, Tokenizer(), {"model": "m", "prompt": long}, _fleet(1),
                          "completions")
    assert pred.cached_prefix_tokens == {"b0": 299 * 16} and threaded == ["_chains"]
    await _predict(kv, Tokenizer(), CHAT, _fleet(1))  # 80 tokens: on the loop
    assert threaded == ["_chains"]
