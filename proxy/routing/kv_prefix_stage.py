"""kv_aware's pre-pick stage: how much of the prompt each candidate's KV cache holds.

The prompt is tokenized as the server will tokenize it: by a candidate's own
`/tokenize` (vLLM applies the chat template there for a `messages` body, with the
same defaults as a chat completion: generation prompt on, no extra special tokens),
then hashed into vLLM's block chain once per distinct hashing config
(proxy/routing/block_hashes.py) and looked up in the exact index of each candidate
with KV events (proxy/fleet/kv_index.py). One `/tokenize` per request: candidates of
one request serve one model, so one tokenizer (a model group mixing tokenizers would
only miss). A failure or a timeout leaves `cached_prefix_tokens` None and the policy
falls back to its approximation; a candidate without events is left out of the map.

Not measured yet: a local tokenizer (no round trip) against `/tokenize`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
from typing import Any, Protocol

import httpx

from proxy.config import KvEventsConfig
from proxy.fleet.kv_index import KvIndex
from proxy.relay.upstream import backend_auth
from proxy.routing.block_hashes import BlockHasher
from proxy.routing.stages import ModelOn, base_model
from proxy.types import Backend, CachedPrefix, ClusterView, Prediction, RequestContext

log = logging.getLogger("laneway")
# Hashing costs ~7 µs a block (sha256; 14 with sha256_cbor): a longer prompt is hashed in
# a worker thread, where the GIL's switch interval keeps the other streams flowing
# (a 32k-token prompt in blocks of 16 is 15-27 ms of hashing).
INLINE_BLOCKS = 256
# what of a request body shapes its tokens (vLLM's TokenizeChatRequest fields)
_CHAT_KEYS = ("messages", "add_generation_prompt", "continue_final_message",
              "add_special_tokens", "chat_template", "chat_template_kwargs", "tools")


class KvEvents(Protocol):
    """What the stage reads of the fleet's KV events (proxy/fleet/kv_fleet.py's KvFleet)."""

    index: KvIndex

    def config_of(self, backend: str) -> KvEventsConfig | None: ...


class CachedPrefixStage:
    def __init__(self, spec: CachedPrefix, kv: KvEvents, model_on: ModelOn = base_model,
                 tls: ssl.SSLContext | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._kv = kv
        self._model_on = model_on
        self._client = httpx.AsyncClient(timeout=spec.tokenize_timeout_s, transport=transport,
                                         verify=tls or True)
        self._hashers: dict[KvEventsConfig, BlockHasher] = {}
        self.failures = 0  # requests whose prompt could not be tokenized

    async def close(self) -> None:
        await self._client.aclose()

    async def predict(self, ctx: RequestContext, data: dict[str, Any], pred: Prediction,
                      view: ClusterView) -> Prediction:
        followed = [(b, cfg) for b in view.candidates
                    if (cfg := self._kv.config_of(b.name)) is not None]
        if not followed:
            return pred
        # the least busy of them tokenizes (vLLM tokenizes in its API server process)
        tokenizer = min((b for b, _ in followed), key=view.inflight_of)
        tokens = await self._tokens(ctx, data, tokenizer)
        if tokens is None:
            return pred
        hashers = {cfg: self._hasher(cfg) for _, cfg in followed}
        if len(tokens) // min(c.block_size for c in hashers) > INLINE_BLOCKS:
            chains = await asyncio.to_thread(_chains, hashers, tokens)
        else:
            chains = _chains(hashers, tokens)
        cached = {backend.name: self._kv.index.longest_prefix(backend.name, chains[cfg])
                  * cfg.block_size for backend, cfg in followed}
        return dataclasses.replace(pred, cached_prefix_tokens=cached)

    def _hasher(self, cfg: KvEventsConfig) -> BlockHasher:
        hasher = self._hashers.get(cfg)
        if hasher is None:
            hasher = self._hashers[cfg] = BlockHasher(cfg.hash_algo, cfg.block_size,
                                                      cfg.hash_seed)
        return hasher

    async def _tokens(self, ctx: RequestContext, data: dict[str, Any],
                      backend: Backend) -> list[int] | None:
        body = self._tokenize_body(ctx, data, self._model_on(backend, ctx.model))
        if body is None:
            return None  # a prompt of token ids is its own tokens; other endpoints: none
        if isinstance(body, list):
            return body
        headers = {"X-Request-Id": ctx.request_id}
        if backend.api_key is not None:
            headers = backend_auth(backend.api_key, headers)
        try:
            response = await self._client.post(backend.url + "/tokenize", json=body,
                                               headers=headers)
            response.raise_for_status()
            tokens = response.json()["tokens"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise ValueError("`tokens` is not a list of token ids")
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self.failures += 1
            log.warning("request %s: /tokenize on %s failed (%s); routing on the "
                        "approximate prefix index", ctx.request_id, backend.name,
                        f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            return None
        return tokens

    @staticmethod
    def _tokenize_body(ctx: RequestContext, data: dict[str, Any],
                       model: str) -> dict[str, Any] | list[int] | None:
        if ctx.endpoint == "chat" and isinstance(data.get("messages"), list):
            body = {k: data[k] for k in _CHAT_KEYS if k in data}
            return {**body, "model": model}
        prompt = data.get("prompt")
        if ctx.endpoint == "completions" and isinstance(prompt, str):
            return {"model": model, "prompt": prompt,
                    "add_special_tokens": data.get("add_special_tokens", True)}
        if (ctx.endpoint == "completions" and isinstance(prompt, list) and prompt
                and all(isinstance(t, int) for t in prompt)):
            return [int(t) for t in prompt]
        return None  # several prompts, the Responses and Messages APIs: not looked up


def _chains(hashers: dict[KvEventsConfig, BlockHasher],
            tokens: list[int]) -> dict[KvEventsConfig, list[int]]:
    return {cfg: hasher.chain(tokens) for cfg, hasher in hashers.items()}
