"""Start `laneway serve` as a real subprocess for integration tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.harness.ports import free_port


@dataclass(frozen=True, slots=True)
class ProxyProcess:
    url: str
    pid: int
    config_path: str = ""  # the YAML it was started with (rewrite + SIGHUP to reload)


@contextlib.contextmanager
def running_proxy(
    config: dict[str, Any], *, ready_timeout_s: float = 30.0, log_path: Path | None = None,
    port: int | None = None, append_log: bool = False
) -> Iterator[ProxyProcess]:
    """Write `config` (server.port: `port`, or one chosen here), start `laneway serve`,
    yield it; its output goes to `log_path` if given (kept; added to with
    `append_log`), else to a temporary file."""
    port = port or free_port()
    config = {**config, "server": {**config.get("server", {}), "host": "127.0.0.1",
                                    "port": port}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "laneway.yaml"
        path.write_text(yaml.safe_dump(config))
        log_file = log_path or Path(tmp) / "proxy.log"
        log = open(log_file, "ab" if append_log else "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "serve", "--config", str(path)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        scheme = "https" if config["server"].get("tls_certfile") else "http"
        url = f"{scheme}://127.0.0.1:{port}"
        failed = False
        try:
            _wait_ready(url, proc, ready_timeout_s, log_file)
            yield ProxyProcess(url, proc.pid, str(path))
        except BaseException:
            failed = True
            raise
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
            if failed:  # e.g. a test's assertion inside the block: show what the proxy said
                lines = log_file.read_text(errors="replace").splitlines()
                print("\n".join(["--- proxy log (tail) ---", *lines[-80:]]))


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"proxy exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            # (only whether it listens: an HTTPS proxy's certificate is the test's to check)
            httpx.get(f"{url}/metrics", timeout=1.0, verify=False)
            return
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError(f"proxy not ready in {timeout_s}s:\n{log.read_text()[-3000:]}")
