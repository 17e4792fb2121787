"""vLLM's disaggregated-prefill handshake over HTTP (`kv_transfer_params`).

As vLLM's own PD proxy does it (`tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py`): the prefill request carries `REMOTE_DECODE`, is not streamed
and has `max_tokens=1`; a prefill server with a KV connector (e.g. NixlConnector)
keeps the prompt's KV blocks and answers with a top-level `kv_transfer_params` handle
(engine id, block ids, side-channel host and port); the decode request is the
client's, with that handle as its `kv_transfer_params`, so the decode server pulls the
blocks instead of prefilling again. The handle is the proxy's business: a client never
sees one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import orjson

from proxy.types import Prediction

# The prefill request's `kv_transfer_params`: "keep the KV for a remote decode".
REMOTE_DECODE: Mapping[str, Any] = MappingProxyType({
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PrefilledPrediction(Prediction):
    """A prediction completed by a prefill leg whose backend holds the prompt's KV for
    the decode backend. The handle is no cost estimate and no policy reads it, hence a
    subclass rather than a field every prediction has: only the handler does, to put it
    into the decode request's body (never into a migration's continuation: its target
    continues from other tokens and has nothing to pull)."""

    kv_transfer_params: Mapping[str, Any] = dataclasses.field(hash=False)

    @classmethod
    def of(cls, pred: Prediction, handle: Mapping[str, Any]) -> PrefilledPrediction:
        fields = {f.name: getattr(pred, f.name) for f in dataclasses.fields(Prediction)}
        return cls(**fields, kv_transfer_params=MappingProxyType(dict(handle)))


def handle_of(pred: Prediction) -> Mapping[str, Any] | None:
    return pred.kv_transfer_params if isinstance(pred, PrefilledPrediction) else None


def returned_handle(response: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The handle in a prefill response (top level, as vLLM returns it), if any."""
    handle = response.get("kv_transfer_params")
    return handle if isinstance(handle, dict) and handle else None


def without_handle(body: bytes) -> bytes:
    """A whole (non-streamed) decode response with `kv_transfer_params` nulled: in
    vLLM's bidirectional mode the decode server returns a handle to its own blocks."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(data, dict) or data.get("kv_transfer_params") is None:
        return body
    return orjson.dumps(data | {"kv_transfer_params": None})
