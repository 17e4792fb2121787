"""A proxy process's lifecycle: SIGHUP reloads its config, SIGTERM lets open streams
finish within `server.shutdown_timeout_s` and cuts them after it."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from bench.harness.proxy_process import ProxyProcess, running_proxy
from bench.harness.services import running_fakes
from tests.proxy.fakes import ADMIN, ADMIN_TOKEN


def stream(proxy: ProxyProcess, tokens: int) -> list[str]:
    body = {"model": "fake", "max_tokens": tokens, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body,
                      timeout=60) as response:
        return [line for line in response.iter_lines() if line.startswith("data: ")]


def exited(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def wait_exit(pid: int, timeout_s: float) -> float:
    started = time.monotonic()
    while not exited(pid):
        assert time.monotonic() - started < timeout_s, "proxy did not exit"
        time.sleep(0.05)
    return time.monotonic() - started


def test_sighup_reloads_backends_and_policy() -> None:
    with running_fakes(2) as urls:
        fleet = [{"name": f"f{i}", "url": u, "model": "fake"} for i, u in enumerate(urls)]
        cfg = {"backends": fleet[:1], "policy": {"name": "round_robin"},
               "admin": {"token": ADMIN_TOKEN}}
        with running_proxy(cfg) as proxy:
            written = yaml.safe_load(Path(proxy.config_path).read_text())
            written.update(backends=fleet[1:], policy={"name": "least_request"})
            Path(proxy.config_path).write_text(yaml.safe_dump(written))
            os.kill(proxy.pid, signal.SIGHUP)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                listing = httpx.get(f"{proxy.url}/admin/backends", headers=ADMIN).json()
                if [b["name"] for b in listing["backends"]] == ["f1"]:
                    break
                time.sleep(0.1)
            assert listing["policy"]["name"] == "least_request"
            assert [b["name"] for b in listing["backends"]] == ["f1"]
            assert not exited(proxy.pid)  # SIGHUP did not stop it


@pytest.mark.parametrize(("tokens", "deadline_s", "completes"), [(60, 10, True),
                                                                 (400, 1, False)])
def test_sigterm_finishes_open_streams_within_the_deadline(
        tokens: int, deadline_s: int, completes: bool) -> None:
    with running_fakes(1, "--tpot-ms", "25") as urls, ThreadPoolExecutor(2) as pool:
        cfg = {"backends": [{"name": "f0", "url": urls[0], "model": "fake"}],
               "server": {"shutdown_timeout_s": deadline_s}}
        with running_proxy(cfg) as proxy:
            open_stream = pool.submit(stream, proxy, tokens)  # 60: 1.5 s; 400: 10 s
            time.sleep(0.5)
            os.kill(proxy.pid, signal.SIGTERM)
            signalled = time.monotonic()
            time.sleep(0.3)
            assert not exited(proxy.pid)  # still finishing the open stream ...
            with pytest.raises(httpx.TransportError):  # ... but taking no new requests
                httpx.get(f"{proxy.url}/health", timeout=1)
            wait_exit(proxy.pid, deadline_s + 8)
            took = time.monotonic() - signalled
            if completes:
                events = open_stream.result()
                assert events[-1] == "data: [DONE]"
                assert sum('"content":"tok' in e for e in events) == tokens
                assert took < 3
            else:
                with pytest.raises(httpx.HTTPError):
                    open_stream.result()
                assert deadline_s <= took < deadline_s + 4
