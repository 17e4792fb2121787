"""`laneway` command line: serve the proxy, manage local backends, run tools."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from proxy.access import configure_logging
from proxy.config import ConfigError, load_settings, load_settings_and_policy


def _serve(args: argparse.Namespace) -> int:
    settings, policy = load_settings_and_policy(args.config)  # serve routes with this build
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if overrides:
        server = settings.server.model_copy(update=overrides)
        settings = settings.model_copy(update={"server": server})
    configure_logging(settings.server.log_level, settings.server.log_format)
    from proxy.server import run

    run(settings, args.config, policy)
    return 0


def _check_config(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    print(f"config ok: {len(settings.backends)} backends, policy {settings.policy.name}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="laneway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the routing proxy")
    serve.add_argument("--config", "-c", help="YAML config file (env LANEWAY_… overrides)")
    serve.add_argument("--host", help="override server.host")
    serve.add_argument("--port", type=int, help="override server.port")
    serve.set_defaults(func=_serve)
    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("--config", "-c", required=True)
    check.set_defaults(func=_check_config)
    from bench import backends  # light module: heavy imports happen inside its commands
    from bench import cli as bench_cli
    from bench.emulator import cli as emulator_cli

    backends.add_cli(sub)
    bench_cli.add_cli(sub)
    emulator_cli.add_cli(sub)
    from predictors import cli as predictors_cli  # torch/sklearn load inside its commands

    predictors_cli.add_cli(sub)
    from proxy import keys_cli

    keys_cli.add_cli(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"laneway: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.filename is None:  # not about a file the user named: keep the traceback
            raise
        print(f"laneway: {exc}", file=sys.stderr)  # a missing data file, checkpoint, …
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
