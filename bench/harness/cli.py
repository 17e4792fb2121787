"""`python -m bench workload|run|solo|report`: the measurement harness's command line.

Kept light: `python -m bench` builds this parser on every start; the commands import the
harness (`bench.harness.commands`) only when they run.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.harness.solo import SLO_BASES
from predictors.home import DATASETS


def _command(name: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        from bench.harness import commands

        code: int = getattr(commands, name)(args)
        return code

    return run


def _workload_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", required=True,
                       help="trace | poisson | gamma | onoff, or a saved workload .jsonl")
    group.add_argument("--shared", default=str(DATASETS),
                       help="folder holding data/ and traces/ (default: <repo>/datasets)")
    group.add_argument("--requests", type=int, default=100, help="requests to build")
    group.add_argument("--duration", type=float,
                       help="seconds of arrivals to build (and to send from a saved file)")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--rate", type=float, default=1.0, help="λ, requests/s (alpaca kinds)")
    group.add_argument("--cv", type=float, default=2.0, help="gamma: coefficient of variation")
    group.add_argument("--on-s", type=float, default=10.0, help="onoff: on window, s")
    group.add_argument("--off-s", type=float, default=10.0, help="onoff: off window, s")
    group.add_argument("--expert", default="gpt-3.5-turbo-1106",
                       help="alpaca: whose answer length each request asks for")
    group.add_argument("--prompts", choices=("all", "heldout"), default="all",
                       help="alpaca: every prompt, or only the held-out split (ids %% 5 == "
                       "0) the project's predictors never trained on")
    group.add_argument("--trace", default="conversation",
                       help="trace: conversation | synthetic | path to a Mooncake .jsonl")
    group.add_argument("--time-scale", type=float, default=1.0,
                       help="trace: arrival offsets are multiplied by this (0.5 = 2x faster)")
    group.add_argument("--start-s", type=float, default=0.0, help="trace: skip lines before")
    group.add_argument("--context", type=int, default=1024,
                       help="backends' max-model-len: prompt + output must fit")
    group.add_argument("--length-scale", type=float,
                       help="divide prompt lengths by this (trace default: automatic)")
    group.add_argument("--output-scale", type=float,
                       help="divide output lengths by this (default: --length-scale, or 1)")
    group.add_argument("--max-output", type=int, help="cap on max_tokens")
    group.add_argument("--tokenizer", default="auto",
                       help="auto (the tiny models' BPE if built, else words) | words | path")


def _send_options(parser: argparse.ArgumentParser, default_out: str) -> None:
    group = parser.add_argument_group("sending")
    group.add_argument("--model", default="tiny-llama", help="model name sent in requests")
    group.add_argument("--max-requests", type=int, help="send at most this many")
    group.add_argument("--request-timeout", type=float, default=600.0, help="s, per request")
    group.add_argument("--out", help=f"result file (default: $LANEWAY_HOME/bench/{default_out})")
    group.add_argument("--header", action="append", default=[],
                       help="'Name: value' sent with every request (repeatable)")
    group.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    group.add_argument("--hide-length", type=int, metavar="N",
                       help="ask for max(N, the request's length) tokens and stop reading at "
                       "its length, so the proxy cannot learn the answer length from "
                       "max_tokens (default: ask for exactly its length)")


def _run_parser(sub: Any) -> None:
    run = sub.add_parser("run", help="send a workload through the proxy and record it")
    _workload_options(run)
    _send_options(run, "<label>.jsonl")
    where = run.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="URL of a running proxy")
    where.add_argument("--config", help="laneway YAML: start a proxy for the run")
    run.add_argument("--policy", help="policy (overrides --config's); with --target a label")
    run.add_argument("--proxy-log", help="with --config: keep the proxy's log in this file "
                     "(default: discarded)")
    run.add_argument("--label", help="run name in reports (default: policy)")
    run.add_argument("--time-limit", type=float, help="s of wall time; open requests are cut")
    run.add_argument("--concurrency", type=int, help="cap on open requests (default: none)")
    run.add_argument("--solo", action="append", default=[],
                     help="solo file: send each request's SLO (x-laneway-slo-ms)")
    run.add_argument("--slo-scale", type=float, default=2.0, help="SLO = scale x solo")
    slo_base_option(run)
    run.set_defaults(func=_command("run"))


def slo_base_option(parser: argparse.ArgumentParser, note: str = "") -> None:
    """`--slo-base` (bench/harness/solo.py), for every command that sets or judges SLOs; `note`
    ends its help."""
    parser.add_argument("--slo-base", choices=SLO_BASES, default="request",
                        help="request: each request's SLO is scale x its own solo latency; "
                        "median: scale x the median solo latency, one deadline for all "
                        "(the paper's 'median request execution time', bench/harness/solo.py)"
                        + note)


def _solo_parser(sub: Any) -> None:
    solo = sub.add_parser("solo", help="solo latencies: each request alone on a backend")
    _workload_options(solo)
    _send_options(solo, "solo.jsonl")
    solo.add_argument("--target", action="append", required=True,
                      help="URL of an idle backend (the SLO's base kind); repeat with "
                      "identical idle backends to measure on all at once, one request at "
                      "a time on each")
    solo.add_argument("--repeats", type=int, default=1, help="measurements per request")
    solo.set_defaults(func=_command("solo"))


def _report_parser(sub: Any) -> None:
    report = sub.add_parser("report", help="tables and PNG plots of result files")
    report.add_argument("results", nargs="+", help="result files of `python -m bench run`")
    report.add_argument("--solo", action="append", default=[], help="solo file(s)")
    report.add_argument("--scales", default="1,1.5,2,2.5,3", help="SLO scales")
    slo_base_option(report)
    report.add_argument("--load-scale", type=float, default=2.0,
                        help="SLO scale of the goodput-vs-load plot")
    report.add_argument("--qos-latency-ms", type=float, default=30.0,
                        help="QoS latency-per-token requirement L")
    report.add_argument("--expert-map", action="append", default=[],
                        help="backend=expert for QoS scores (repeatable)")
    report.add_argument("--out-dir", help="default: $LANEWAY_HOME/bench/report")
    report.set_defaults(func=_command("report"))


def add_cli(sub: Any) -> None:
    """`workload`, `run`, `solo` and `report`, as commands of `python -m bench`."""
    workload = sub.add_parser("workload", help="build a workload, save it, print its shape")
    _workload_options(workload)
    workload.add_argument("--out", help="save as JSONL")
    workload.set_defaults(func=_command("workload"))
    _run_parser(sub)
    _solo_parser(sub)
    _report_parser(sub)
