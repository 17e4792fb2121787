"""ELDR's first stage in PD mode: a prefill leg that yields the expert signature.

With `policy.params.pd: true`, before the decode pick the proxy sends the request
with `max_tokens=1` to a backend labelled `role: prefill` (prefix-aware pick among
them, for KV reuse), reads the leg's expert counts from that backend's laneway_eldr
side endpoint (label `eldr_url`), and hands the embedded signature to the policy,
which then picks among the other backends (the decode pool). A server started with
vLLM's `--enable-return-routed-experts` (GPU) returns the leg's routing in the
response itself; then no side endpoint is needed. Without a KV-transfer
connector (CPU) the decode backend re-prefills; with vLLM's KV connectors on GPU the
same two picks drive a real PD deployment. Any failure of this stage leaves the
prediction without a signature: the policy then balances load.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import logging
from typing import Any

import httpx
import numpy as np

from policies.eldr import Eldr
from policies.prefix_aware import PrefixAware, PrefixAwareParams
from predictors.base import Prediction
from proxy.types import ClusterView, RequestContext

log = logging.getLogger("laneway")
PREFILL_ROLE = "prefill"
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class PrefillStage:
    def __init__(self, policy: Eldr, timeout_s: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._policy = policy
        self._prefix = PrefixAware(PrefixAwareParams())
        self._client = httpx.AsyncClient(timeout=timeout_s, transport=transport)

    async def close(self) -> None:
        await self._client.aclose()

    async def predict(self, ctx: RequestContext, data: dict[str, Any], pred: Prediction,
                      view: ClusterView) -> Prediction:
        pool = tuple(b for b in view.candidates if b.labels.get("role") == PREFILL_ROLE)
        if not pool:
            return pred
        backend = self._prefix.pick(ctx, pred, dataclasses.replace(view, candidates=pool)).backend
        leg = {**data, "model": backend.model, "max_tokens": 1, "stream": False}
        leg.pop("max_completion_tokens", None)
        leg.pop("stream_options", None)
        try:
            response = await self._client.post(
                backend.url + _PATHS[ctx.endpoint], json=leg,
                headers={"X-Request-Id": ctx.request_id})
            response.raise_for_status()
            counts = routed_counts(response.json(), self._policy.counts_shape)
            if counts is None:  # no routed_experts field: ask the plugin's side endpoint
                record = await self._client.get(
                    f"{backend.labels['eldr_url']}/eldr/requests/{ctx.request_id}")
                record.raise_for_status()
                counts = np.array(record.json()["prefill"], float)
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            log.warning("request %s: ELDR prefill leg on %s failed (%s); no signature",
                        ctx.request_id, backend.name, exc)
            return pred
        return dataclasses.replace(pred, expert_signature=self._policy.signature(counts))


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
