"""`python -m bench COMMAND`: laneway's development tools, in a checkout.

Not part of the proxy's package: local vLLM-CPU backends of the tiny models
(`backends`), the emulated vLLM fleet (`emulate`), the measurement harness
(`workload`, `run`, `solo`, `report`) and qos_drl's SAC trainer (`train qos-drl`).
The research studies are modules of `bench.studies` (`make bench-…`, docs: Benchmarks).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from bench.emulator import cli as emulator_cli
from bench.harness import cli as harness_cli
from bench.models import backends
from bench.studies.qos import cli as qos_cli
from proxy.cli import run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    backends.add_cli(sub)  # light modules: heavy imports happen inside their commands
    emulator_cli.add_cli(sub)
    harness_cli.add_cli(sub)
    train = sub.add_parser("train", help="train a policy").add_subparsers(
        dest="train_command", required=True)
    qos_cli.add_train(train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
