"""`python -m bench emulate`: many emulated vLLM instances, in one process or split over K.

Instances are planned here (names, ports, profiles cycled), served by
`serve_fleet` in each process, and written to a laneway config so the proxy can be
pointed at them. The command runs until SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.emulator.profile import Profile, dilated, load_profile


@dataclass(frozen=True, slots=True)
class Planned:
    name: str
    profile: str  # name or path, loaded in the serving process
    model: str | None  # None: the profile's model
    port: int  # per-instance port; with a shared port, the fleet's


def plan(n: int, profiles: Sequence[str], base_port: int, shared_port: bool,
         model: str | None = None) -> list[Planned]:
    return [Planned(f"emu-{i}", profiles[i % len(profiles)], model,
                    base_port if shared_port else base_port + i) for i in range(n)]


def url_of(spec: Planned, host: str, shared_port: bool) -> str:
    return f"http://{host}:{spec.port}" + (f"/{spec.name}" if shared_port else "")


def laneway_config(specs: Sequence[Planned], host: str, shared_port: bool,
                   policy: str = "round_robin") -> dict[str, Any]:
    profiles = {name: load_profile(name) for name in {s.profile for s in specs}}
    return {
        "server": {"host": "127.0.0.1", "port": 8000},
        "backends": [{"name": s.name, "url": url_of(s, host, shared_port),
                      "model": s.model or profiles[s.profile].model,
                      "labels": {"profile": profiles[s.profile].name}} for s in specs],
        "policy": {"name": policy, "params": {}},
    }


def serve_slice(specs: Sequence[Planned], host: str, shared_port: bool,
                time_dilation: float = 1.0) -> None:
    """Serve `specs` in this process (uvloop) until SIGINT/SIGTERM; every profile
    `dilated` by `time_dilation`."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve(specs, host, shared_port, time_dilation))


async def _serve(specs: Sequence[Planned], host: str, shared_port: bool,
                 time_dilation: float) -> None:
    from bench.emulator.server import Instance, serve_fleet

    loaded: dict[str, Profile] = {}
    instances = []
    for spec in specs:
        if spec.profile not in loaded:
            loaded[spec.profile] = dilated(load_profile(spec.profile), time_dilation)
        profile = loaded[spec.profile]
        instances.append(Instance(spec.name, profile, spec.model or profile.model, spec.port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    async with serve_fleet(instances, host, specs[0].port if shared_port else None) as fleet:
        # after uvicorn started: its own signal capture would leave this loop waiting
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        print(f"{len(instances)} emulated instances ready in pid {os.getpid()}: "
              f"{fleet.urls[0]} .. {fleet.urls[-1]}", flush=True)
        await stop.wait()


def run(specs: Sequence[Planned], host: str, shared_port: bool, processes: int,
        time_dilation: float = 1.0) -> None:
    """Serve the fleet, split into `processes` contiguous slices; block until a signal."""
    if processes <= 1:
        serve_slice(specs, host, shared_port, time_dilation)
        return
    if shared_port:
        raise ValueError("a shared port needs one process: instances live in one loop")
    context = multiprocessing.get_context("spawn")
    size = -(-len(specs) // processes)
    children = []
    stopped = False

    def _stop(*_: Any) -> None:
        nonlocal stopped
        stopped = True

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop)
    try:
        for start in range(0, len(specs), size):
            child = context.Process(
                target=serve_slice, daemon=True,
                args=(specs[start:start + size], host, False, time_dilation))
            child.start()
            children.append(child)
        while not stopped and all(child.is_alive() for child in children):
            time.sleep(0.5)
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()


def write_config(specs: Sequence[Planned], host: str, shared_port: bool, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(laneway_config(specs, host, shared_port), sort_keys=False))
