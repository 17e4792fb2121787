"""A request's SLO class, and what it adds to the body sent to a backend.

The class is chosen at admission: the key's `slo_class` with `auth` on (a client
header cannot change it), else the `x-laneway-slo-class` header, else
`default_slo_class`; a header naming no configured class is a 400 before anything
else reads it (the class is a metric label). A backend opts in with its `scheduler`
label (proxy/config.py): `slice` gets the class in `vllm_xargs` (the laneway_slice
plugin reads them: deploy/vllm_plugins/laneway_slice) and vLLM's `priority`,
`priority` gets only the priority. A tenant cannot promote itself past its class: the
client's own `priority`, `X-Vllm-Priority` and `vllm_xargs.laneway_*` are stripped from
every request (proxy/request_context.py, proxy/relay/upstream.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.admission.auth import Grant
from proxy.config import SCHEDULER_LABEL, Settings
from proxy.errors import InvalidRequest
from proxy.types import Backend, Endpoint, SloTarget

SLO_CLASS_HEADER = "x-laneway-slo-class"
XARG_PREFIX = "laneway_"  # the plugin's keys: laneway_slo_class, laneway_tpot_ms, ...
_SHOWN = 40  # characters of a bad header value quoted back


def class_of(settings: Settings, grant: Grant | None, headers: Mapping[str, str]
             ) -> SloTarget | None:
    """The request's class; None when no `slo_classes` are configured. Raises
    `InvalidRequest` for a header naming no class (only read with `auth` off)."""
    classes, default = settings.slo_classes, settings.default_slo_class
    if not classes or default is None:
        return None
    if grant is not None:  # a Redis-stored key may name a class since removed
        name = grant.key.slo_class if grant.key.slo_class in classes else default
    else:
        name = headers.get(SLO_CLASS_HEADER, default)
        if name not in classes:
            raise InvalidRequest(
                f"{SLO_CLASS_HEADER} names no SLO class: {name[:_SHOWN]!r} (known: "
                f"{', '.join(sorted(classes))}).")
    cfg = classes[name]
    return SloTarget(name, cfg.tpot_ms, cfg.utility, cfg.priority, cfg.ttft_ms,
                     cfg.deadline_ms)


def upstream_body(data: Mapping[str, Any], target: SloTarget, backend: Backend,
                  endpoint: Endpoint, elapsed_s: float) -> dict[str, Any]:
    """`data` as `backend` gets it: with the class's priority and plugin keys where
    `backend` opts in. The client's own `priority`, `vllm_xargs.laneway_*` and
    `X-Vllm-Priority` never get this far (proxy/request_context.py and
    proxy/relay/upstream.py strip them from every request). `elapsed_s`: since the
    request arrived (a deadline is sent as what is left of it)."""
    body = dict(data)
    scheduler = backend.labels.get(SCHEDULER_LABEL)
    if scheduler == "slice":
        own = body.get("vllm_xargs")
        body["vllm_xargs"] = (own if isinstance(own, dict) else {}) | slice_xargs(
            target, elapsed_s)
    if scheduler in ("slice", "priority") and endpoint != "messages":
        body["priority"] = target.priority  # (Anthropic's schema has no priority)
    return body


def slice_xargs(target: SloTarget, elapsed_s: float) -> dict[str, str | float]:
    """The plugin's keys for `target` (flat values, as vLLM requires). A deadline
    already passed is left out: the class's TPOT applies, where an impossible rate
    would only stop the plugin's greedy selection at this request."""
    xargs: dict[str, str | float] = {
        f"{XARG_PREFIX}slo_class": target.name, f"{XARG_PREFIX}tpot_ms": target.tpot_ms,
        f"{XARG_PREFIX}utility": target.utility}
    if target.deadline_ms is not None:
        left_ms = round(target.deadline_ms - elapsed_s * 1000, 1)
        if left_ms > 0:
            xargs[f"{XARG_PREFIX}deadline_ms"] = left_ms
    return xargs
