"""Real Redis and Prometheus servers as child processes (tests, `make stack-local`).

Both come from Debian packages (`redis-server`, `prometheus`); `make services`
installs them. Each runs in a temporary directory, on a port chosen by the caller,
and is stopped (SIGTERM, then SIGKILL) when the block ends.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.harness.ports import free_port
from predictors.home import REPO


class MissingService(RuntimeError):
    """The server's binary is not installed."""


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise MissingService(f"`{name}` is not installed (Debian: `make services` or "
                             f"`apt-get install -y {name}`)")
    return path


class RedisServer:
    """A throwaway redis-server (no persistence) on one port, which can be killed and
    started again there (a restarted Redis comes back empty, as a failed-over one
    without persistence does)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.TemporaryDirectory()
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [binary("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", self._dir.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        _wait(lambda: _redis_ping(self.port), self._proc, 10.0, "redis-server")

    def kill(self) -> None:
        """kill -9, as a crash."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()

    def close(self) -> None:
        if self._proc is not None:
            stop_process(self._proc)
        self._dir.cleanup()


@contextlib.contextmanager
def running_redis(port: int | None = None) -> Iterator[str]:
    """A throwaway redis-server (no persistence); yields its redis:// URL."""
    server = RedisServer(port)
    try:
        server.start()
        yield server.url
    finally:
        server.close()


def _redis_ping(port: int) -> bool:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(16).startswith(b"+PONG")


ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"  # the deployment's rules


def prometheus_config(targets: dict[str, list[str]], interval_s: float = 1.0
                      ) -> dict[str, Any]:
    """Scrape config: job name -> host:port targets, all at `interval_s`, with the
    deployment's alerting rules."""
    interval = f"{round(interval_s * 1000)}ms"  # Prometheus durations are integers
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": hosts}]}
            for job, hosts in targets.items()
        ],
    }


@contextlib.contextmanager
def running_prometheus(config: dict[str, Any], port: int | None = None) -> Iterator[str]:
    """A throwaway Prometheus with `config`; yields its base URL."""
    port = port or free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        log = open(Path(tmp) / "prometheus.log", "wb")
        proc = subprocess.Popen(
            [binary("prometheus"), f"--config.file={path}", f"--storage.tsdb.path={tmp}/data",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
            stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait(lambda: httpx.get(f"{url}/-/ready", timeout=1).status_code == 200,
                  proc, 30.0, "prometheus")
        except RuntimeError:
            log.close()
            raise RuntimeError((Path(tmp) / "prometheus.log").read_text()[-2000:]) from None
        try:
            yield url
        finally:
            stop_process(proc)
            log.close()


def _wait(ready: Any, proc: subprocess.Popen[bytes], timeout_s: float, name: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} during start-up")
        with contextlib.suppress(OSError, httpx.TransportError):
            if ready():
                return
        time.sleep(0.05)
    stop_process(proc)
    raise RuntimeError(f"{name} not ready in {timeout_s}s")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s; returns once it has exited."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running_fakes(count: int, *args: str) -> Iterator[list[str]]:
    """`count` fake vLLM servers (`python -m bench.fakes.fake_vllm <args>`) in processes of
    their own, so that proxies in other processes reach them whatever this one does."""
    import sys

    ports = [free_port() for _ in range(count)]
    procs = [subprocess.Popen([sys.executable, "-m", "bench.fakes.fake_vllm", "--port", str(port),
                               *args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
             for port in ports]
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url, proc in zip(urls, procs, strict=True):
            _wait(lambda u=url: httpx.get(f"{u}/v1/models", timeout=1).status_code == 200,
                  proc, 20.0, "fake vLLM")
        yield urls
    finally:
        for proc in procs:
            stop_process(proc)
