"""vLLM general plugin for expert-locality decode routing (ELDR, see laneway's README).

Active only when `LANEWAY_ELDR_PORT` is set. In the process that runs the model it
hooks every MoE router's top-k selection, counts per request, per layer, per expert
the prefill tokens routed there (aggregated per KV block, so a signature stays exact
under prefix caching), counts the distinct experts each decode step activates, and
serves both on a side HTTP endpoint (`LANEWAY_ELDR_HOST`:`LANEWAY_ELDR_PORT`):

* `GET /eldr/requests/<request id>` -- a request's prefill signature and decode counts
* `GET /metrics` -- `laneway_eldr_decode_*` counters (Prometheus text)
"""

from __future__ import annotations

import os

ENV_PORT = "LANEWAY_ELDR_PORT"
ENV_HOST = "LANEWAY_ELDR_HOST"


def register() -> None:
    """The entry point: vLLM calls it in every process, possibly several times."""
    if not os.environ.get(ENV_PORT):
        return
    from laneway_eldr.hooks import install

    install(os.environ.get(ENV_HOST, "127.0.0.1"), int(os.environ[ENV_PORT]))
