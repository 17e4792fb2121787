"""Build the stages a policy declares (`policies.base.Staged`): one builder per kind of
`StageSpec`, so the proxy runs a policy's pre-pick work without knowing the policy."""

from __future__ import annotations

import ssl

from policies.base import Staged
from proxy.routing.eldr_stage import PrefillStage
from proxy.routing.kv_prefix_stage import CachedPrefixStage, KvEvents
from proxy.routing.stages import BucketStage, ModelOn, Stage, base_model
from proxy.types import BatchedBuckets, CachedPrefix, PrefillSignature, StageSpec


def stages_for(policy: object, model_on: ModelOn = base_model,
               tls: ssl.SSLContext | None = None, kv: KvEvents | None = None) -> list[Stage]:
    """The stages of `policy`, in the order it declares them; [] for a policy without.
    `kv`: the fleet's KV events (Runtime.kv), for `CachedPrefix`."""
    specs = policy.stages() if isinstance(policy, Staged) else ()
    return [build_stage(spec, model_on, tls, kv) for spec in specs]


def build_stage(spec: StageSpec, model_on: ModelOn = base_model,
                tls: ssl.SSLContext | None = None, kv: KvEvents | None = None) -> Stage:
    if isinstance(spec, PrefillSignature):
        return PrefillStage(spec, model_on=model_on, tls=tls)
    if isinstance(spec, BatchedBuckets):
        return BucketStage(spec.predictor, spec.max_batch, spec.timeout_s)
    if isinstance(spec, CachedPrefix):
        if kv is None:
            raise TypeError("a CachedPrefix stage needs the fleet's KV events")
        return CachedPrefixStage(spec, kv, model_on=model_on, tls=tls)
    raise TypeError(f"no stage for {type(spec).__name__}")
