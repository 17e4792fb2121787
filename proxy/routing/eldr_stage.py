"""ELDR's first stage in PD mode: a prefill leg that yields the expert signature.

With `policy.params.pd: true`, before the decode pick the proxy sends the request
with `max_tokens=1` to a backend labelled `role: prefill` (prefix-aware pick among
them, for KV reuse), reads the leg's expert counts from that backend's laneway_eldr
side endpoint (label `eldr_url`), and hands the embedded signature to the policy,
which then picks among the other backends (the decode pool). A server started with
vLLM's `--enable-return-routed-experts` (GPU) returns the leg's routing in the
response itself; then no side endpoint is needed. Without a KV-transfer
connector (CPU) the decode backend re-prefills. With `kv_transfer: true` (vLLM servers
with a KV connector, GPU) the leg asks the prefill backend to keep the prompt's KV and
its `kv_transfer_params` go to the decode request (proxy/routing/kv_transfer.py): the same two
picks drive a real PD deployment. Any failure of this stage leaves the prediction
without a signature (the policy then balances load) or without the KV handle (the
decode backend then prefills again); it never fails the request.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import logging
import ssl
from typing import Any

import aiohttp
import httpx
import numpy as np

from policies.prefix_aware import PrefixAware, PrefixAwareParams
from proxy.relay.upstream import backend_auth
from proxy.routing.kv_transfer import REMOTE_DECODE, PrefilledPrediction, returned_handle
from proxy.routing.stages import ModelOn, base_model
from proxy.types import Backend, ClusterView, Prediction, PrefillSignature, RequestContext

log = logging.getLogger("laneway")
PREFILL_ROLE = "prefill"
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class PrefillStage:
    def __init__(self, spec: PrefillSignature, timeout_s: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 model_on: ModelOn = base_model, tls: ssl.SSLContext | None = None) -> None:
        """`model_on`: the name a request names on the prefill backend (a LoRA
        adapter's request prefills with the adapter, as its decode will); `tls`: the
        https backends' CA (None: the system's)."""
        self._spec = spec
        self._model_on = model_on
        self._tls = tls
        self._prefix = PrefixAware(PrefixAwareParams())
        self._client = httpx.AsyncClient(timeout=timeout_s, transport=transport,
                                         verify=tls or True)
        self._kv_transfer = spec.kv_transfer
        self._timeout_s = timeout_s
        self._lookups: aiohttp.ClientSession | None = None  # made on the running loop

    async def close(self) -> None:
        await self._client.aclose()
        if self._lookups is not None:
            await self._lookups.close()

    async def predict(self, ctx: RequestContext, data: dict[str, Any], pred: Prediction,
                      view: ClusterView) -> Prediction:
        pool = tuple(b for b in view.candidates if b.labels.get("role") == PREFILL_ROLE)
        if not pool or ctx.endpoint not in _PATHS:  # no prefill leg for the Responses API
            return pred
        backend = self._prefix.pick(ctx, pred, dataclasses.replace(view, candidates=pool)).backend
        headers = {"X-Request-Id": ctx.request_id}
        if backend.api_key is not None:
            headers = backend_auth(backend.api_key, headers)
        try:
            leg = self._leg(data, self._model_on(backend, ctx.model))
            response = await self._client.post(backend.url + _PATHS[ctx.endpoint], json=leg,
                                               headers=headers)
            response.raise_for_status()
            body = response.json()
            if not isinstance(body, dict):
                raise ValueError("the response is not a JSON object")
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("request %s: ELDR prefill leg on %s failed (%s); no signature%s",
                        ctx.request_id, backend.name, exc,
                        ", the decode backend prefills again" if self._kv_transfer else "")
            return pred
        signature = await self._signature(ctx, backend, body)
        if signature is not None:
            pred = dataclasses.replace(pred, expert_signature=signature)
        return self._with_handle(ctx, backend, body, pred) if self._kv_transfer else pred

    def _leg(self, data: dict[str, Any], model: str) -> dict[str, Any]:
        """The prefill-only request: one token, not streamed (vLLM returns the KV
        handle only in a whole response); vLLM rejects min_tokens > max_tokens."""
        leg = {**data, "model": model, "max_tokens": 1, "stream": False}
        for key in ("max_completion_tokens", "stream_options", "min_tokens"):
            leg.pop(key, None)
        if self._kv_transfer:
            leg["kv_transfer_params"] = dict(REMOTE_DECODE)
        return leg

    async def _signature(self, ctx: RequestContext, backend: Backend, body: dict[str, Any]
                         ) -> tuple[float, ...] | None:
        try:
            counts = routed_counts(body, self._spec.counts_shape)
            if counts is None:  # no routed_experts field: ask the plugin's side endpoint
                record = await self._lookup(backend.labels["eldr_url"], ctx.request_id)
                counts = np.array(record["prefill"], float)
        except (httpx.HTTPError, aiohttp.ClientError, TimeoutError, KeyError, TypeError,
                ValueError) as exc:
            log.warning("request %s: no ELDR signature from the prefill leg on %s (%s)",
                        ctx.request_id, backend.name, exc)
            return None
        return self._spec.signature(counts)

    async def _lookup(self, eldr_url: str, request_id: str) -> Any:
        if self._lookups is None:
            self._lookups = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._tls or True),
                timeout=aiohttp.ClientTimeout(total=self._timeout_s))
        return await eldr_record(self._lookups, eldr_url, request_id)

    @staticmethod
    def _with_handle(ctx: RequestContext, backend: Backend, body: dict[str, Any],
                     pred: Prediction) -> Prediction:
        handle = returned_handle(body)
        if handle is None:
            log.warning("request %s: the prefill leg on %s returned no kv_transfer_params "
                        "(no KV connector on it?); the decode backend prefills again",
                        ctx.request_id, backend.name)
            return pred
        return PrefilledPrediction.of(pred, handle)


async def eldr_record(session: aiohttp.ClientSession, eldr_url: str, request_id: str) -> Any:
    """The plugin's record of a request (`GET <eldr_url>/eldr/requests/<id>`), over
    keep-alive aiohttp as the relay uses: it is on every PD request's path (against a
    server decoding 8 streams, p50 0.4 ms; httpx took 0.7-0.9)."""
    async with session.get(f"{eldr_url}/eldr/requests/{request_id}") as response:
        response.raise_for_status()
        return await response.json()


def routed_counts(response: dict[str, Any], shape: tuple[int, int]) -> np.ndarray | None:
    """Counts [layers, experts] from vLLM's `--enable-return-routed-experts` field (GPU):
    base64 `.npy` of top-k ids [tokens - 1, layers, k]; with `max_tokens=1` the rows
    are exactly the prompt's. None when the server does not return it."""
    encoded = (response.get("choices") or [{}])[0].get("routed_experts")
    if not encoded:
        return None
    ids = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    layers, experts = shape
    counts = np.zeros(shape)
    for layer in range(layers):
        counts[layer] = np.bincount(ids[:, layer].ravel(), minlength=experts)[:experts]
    return counts
