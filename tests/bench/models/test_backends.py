"""The vLLM-CPU launcher's bookkeeping, without vLLM: plans, config, state, stopping."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from bench.models import backends
from bench.models.backends import Running, plan
from bench.models.vllm_server import group_alive
from proxy.config import load_settings


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LANEWAY_HOME", str(tmp_path))
    return tmp_path


def sleeper(name: str) -> Running:
    """A stand-in server: a process group leader with a child, like vLLM's API server."""
    script = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    return Running(name, "small", "tiny-llama", 1, proc.pid)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_plan_cycles_variants_and_names_models() -> None:
    specs = plan(3, ["small", "large"], "tiny-llama", 8100)
    assert [(s.name, s.variant, s.model, s.port) for s in specs] == [
        ("small-0", "small", "tiny-llama", 8100),
        ("large-1", "large", "tiny-llama-large", 8101),
        ("small-2", "small", "tiny-llama", 8102)]


def test_config_is_a_valid_laneway_config(home: Path) -> None:
    servers = [Running("small-0", "small", "tiny-llama", 8100, 1),
               Running("large-1", "large", "tiny-llama-large", 8101, 2)]
    path = home / "laneway.yaml"
    path.write_text(yaml.safe_dump(backends.laneway_config(servers), sort_keys=False))
    settings = load_settings(path)
    assert [(b.name, str(b.url).rstrip("/"), b.model) for b in settings.backends] == [
        ("small-0", "http://127.0.0.1:8100", "tiny-llama"),
        ("large-1", "http://127.0.0.1:8101", "tiny-llama-large")]
    assert settings.policy.name == "round_robin"


def test_down_kills_recorded_process_groups_and_forgets_them(home: Path) -> None:
    servers = [sleeper("a"), sleeper("b")]
    backends.state_file().write_text(json.dumps([s.to_row() for s in servers]))
    assert json.loads(backends.state_file().read_text())[0]["url"] == "http://127.0.0.1:1"
    assert [s.name for s in backends.recorded()] == ["a", "b"]
    stopped = backends.down()
    assert [s.pid for s in stopped] == [s.pid for s in servers]
    assert not any(group_alive(s.pid) for s in servers)  # the `sleep` children too
    assert not backends.state_file().exists() and backends.recorded() == []


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored() -> None:
    script = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "print('ready', flush=True); time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True,
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    started = time.monotonic()
    backends.stop([Running("stubborn", "small", "tiny-llama", 1, proc.pid)], grace_s=0.5)
    assert time.monotonic() - started >= 0.5  # SIGTERM was ignored for the whole grace
    assert not alive(proc.pid)


def test_stop_does_not_wait_for_zombies_another_parent_never_reaps() -> None:
    """`python -m bench backends down` from another shell while the starting process still runs."""
    script = ("import subprocess, time; p = subprocess.Popen(['sleep', '300'], "
              "start_new_session=True); print(p.pid, flush=True); time.sleep(300)")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        server = Running("orphaned", "small", "tiny-llama", 1, int(parent.stdout.readline()))
        started = time.monotonic()
        backends.stop([server], grace_s=5.0)
        assert time.monotonic() - started < 3.0 and not group_alive(server.pid)
    finally:
        parent.kill()
        parent.wait()
