"""Expert-locality decode routing (ELDR, paper: eldr.txt, "Online: Locality-band routing").

The offline fit (`laneway train eldr`) leaves one centroid per decode worker. For a
request with an expert signature s (from its prefill leg), the similarity to worker
k's centroid is s . c_k; the locality band is every worker within `tau` of the best
one, and the request goes to the band's worker with the fewest in-flight requests
(the proxy's exact count). tau = 0 is pure locality, tau >= 2 pure shortest queue.
Requests without a signature, and backends without a centroid, fall back to the
least in-flight backend.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

import numpy as np
from pydantic import BaseModel, Field, ValidationInfo, field_validator

from policies.base import PARAMS_CONFIG, register
from policies.load_helpers import LeastInflight, RotatingArgmin
from predictors.eldr.fit import EldrModel, load
from proxy.types import (
    Backend,
    ClusterView,
    Decision,
    Outcome,
    Prediction,
    PrefillSignature,
    RequestContext,
    StageSpec,
)


class EldrParams(BaseModel):
    model_config = PARAMS_CONFIG
    artifact: str = Field(description="directory (or eldr.json) of `laneway train eldr`")
    tau: float = Field(0.1, ge=0.0, description="locality band width (cosine similarity)")
    pd: bool = Field(False, description="two-stage: a prefill leg on the backends labelled "
                     "role=prefill yields the signature; decode goes to the others")
    kv_transfer: bool = Field(False, description="PD mode on vLLM servers with a KV "
                              "connector (e.g. NixlConnector): the prefill leg asks to keep "
                              "its KV and the decode request gets the leg's "
                              "kv_transfer_params, so the decode backend pulls the KV "
                              "instead of prefilling again")

    @field_validator("kv_transfer")
    @classmethod
    def _needs_pd(cls, kv_transfer: bool, info: ValidationInfo) -> bool:
        if kv_transfer and not info.data.get("pd"):
            raise ValueError("needs pd: true (the KV comes from the prefill leg)")
        return kv_transfer


@register
class Eldr:
    name: ClassVar[str] = "eldr"
    Params: ClassVar[type[BaseModel]] = EldrParams

    def __init__(self, params: EldrParams, model: EldrModel | None = None) -> None:
        self._tau = params.tau
        self.pd = params.pd
        self.kv_transfer = params.kv_transfer
        self._model = model or load(Path(params.artifact))
        self._least = LeastInflight()
        self._argmin = RotatingArgmin()
        self._rows_for: tuple[Backend, ...] | None = None  # candidates `_rows` is for
        self._rows: tuple[tuple[Backend, ...], list[int]] = ((), [])

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        if self.pd:  # the prefill pool never decodes
            decoders = tuple(b for b in view.candidates if b.labels.get("role") != "prefill")
            view = dataclasses.replace(view, candidates=decoders or view.candidates)
        signature = pred.expert_signature
        backends, rows = self._centroid_rows(view.candidates)
        if signature is None or not backends:
            backend, load_now = self._least.pick(view)
            return Decision(backend, f"no expert signature; least in-flight {load_now}")
        similarity = self._model.centroids[rows] @ np.asarray(signature)
        band = np.flatnonzero(similarity >= similarity.max() - self._tau)
        loads = [view.inflight_of(backends[i]) for i in band]
        chosen = int(band[self._argmin(loads)])
        return Decision(backends[chosen], f"locality band of {len(band)} (similarity "
                        f"{similarity[chosen]:.3f}, best {similarity.max():.3f}), "
                        f"in-flight {view.inflight_of(backends[chosen])}")

    def observe(self, outcome: Outcome) -> None:
        pass

    def stages(self) -> tuple[StageSpec, ...]:
        """In PD mode, the prefill leg that yields each request's signature."""
        if not self.pd:
            return ()
        return (PrefillSignature(self.kv_transfer, self.counts_shape, self.signature),)

    @property
    def counts_shape(self) -> tuple[int, int]:
        """(MoE layers, experts) of the counts `signature` takes."""
        layers, experts = self._model.spec.weights.shape
        return int(layers), int(experts)

    def signature(self, counts: np.ndarray) -> tuple[float, ...]:
        """A request's signature from its prefill counts [layers, experts]."""
        return tuple(self._model.spec.embed(counts).tolist())

    def _centroid_rows(self, candidates: tuple[Backend, ...]
                       ) -> tuple[tuple[Backend, ...], list[int]]:
        """Candidates that own a centroid, and its row: by name when the artifact names
        its workers, else the k-th candidate by sorted name owns centroid k."""
        if candidates is self._rows_for:  # the registry reuses the tuple until it changes
            return self._rows
        workers = self._model.workers
        if any(workers):
            pairs = [(b, workers.index(b.name)) for b in candidates if b.name in workers]
        else:
            ordered = sorted(candidates, key=lambda b: b.name)[: len(workers)]
            pairs = [(b, row) for row, b in enumerate(ordered)]
        self._rows_for = candidates
        self._rows = (tuple(b for b, _ in pairs), [row for _, row in pairs])
        return self._rows
