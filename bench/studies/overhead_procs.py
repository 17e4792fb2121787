"""The overhead benchmark's processes: fakes, laneway, the bare relay. Each is a
context manager that always stops its process (terminate, then kill)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

from bench.harness.ports import free_port
from bench.harness.proxy_process import ProxyProcess, running_proxy
from bench.harness.services import stop_process
from predictors.home import REPO

_START_TIMEOUT_S = 30.0


@contextlib.contextmanager
def child(args: list[str], ready_url: str) -> Iterator[subprocess.Popen[bytes]]:
    """Run `python args...` until the block ends; wait until `ready_url` answers 200."""
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO)
    try:
        wait_ok(ready_url, proc)
        yield proc
    finally:
        stop_process(proc)


def wait_ok(url: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready in {_START_TIMEOUT_S}s")
        time.sleep(0.05)


@contextlib.contextmanager
def fake_process(tpot_ms: float, model: str, ttft_ms: float = 0.0) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with child(["-m", "bench.fakes.fake_vllm", "--port", str(port), "--model", model,
                "--tpot-ms", str(tpot_ms), "--ttft-ms", str(ttft_ms)], f"{url}/health"):
        yield url


@contextlib.contextmanager
def minimal_relay(upstream: str) -> Iterator[tuple[str, int]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with child(["-m", "bench.fakes.minimal_relay", upstream, str(port)], f"{url}/health") as proc:
        yield url, proc.pid


@contextlib.contextmanager
def otlp_sink() -> Iterator[str]:
    """An OTLP/HTTP receiver in a process of its own (bench/fakes/otlp_sink.py): its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with child(["-m", "bench.fakes.otlp_sink", "--port", str(port), "--quiet"], f"{url}/health"):
        yield url


@contextlib.contextmanager
def proxy_for(fast: str, paced: str, tracking: bool = True, traces_url: str | None = None
              ) -> Iterator[ProxyProcess]:
    """`laneway serve` routing model `fast` and model `paced` to their fakes.

    `tracking`: streams are tracked for migration (the default config: every event
    decoded and re-emitted); off, the proxy relays stream bytes untouched. `traces_url`:
    every request traced (`sample_ratio` 1), its spans sent there."""
    config = {"backends": [{"name": "fast", "url": fast, "model": "fast"},
                           {"name": "paced", "url": paced, "model": "paced"}],
              "policy": {"name": "round_robin", "params": {}},
              "poller": {"interval_s": 0.1},
              "server": {"log_level": "warning"},
              "migration": {"enabled": tracking}}
    if traces_url is not None:
        config["tracing"] = {"otlp_endpoint": f"{traces_url}/v1/traces"}
    with running_proxy(config) as proxy:
        wait_ok(f"{proxy.url}/health")  # 200 once the poller has seen both backends
        yield proxy
