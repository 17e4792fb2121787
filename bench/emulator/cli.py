"""`python -m bench emulate ...`: emulated vLLM fleets, profile fitting, calibration.

    python -m bench emulate --n 512 --profile h100-80gb,a100-40gb --base-port 9000
    python -m bench emulate profiles
    python -m bench emulate fit --variant small
    python -m bench emulate calibrate --variants small,large [--refit]

Kept light: `proxy.cli` builds this parser on every start; commands import their
modules only when they run.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from predictors.home import REPO, laneway_home


def _run(args: argparse.Namespace) -> int:
    from bench.emulator import fleet
    from bench.emulator.profile import load_profile

    profiles = args.profile.split(",")
    if args.time_dilation <= 0:
        raise SystemExit(f"--time-dilation must be positive, got {args.time_dilation}")
    for name in profiles:
        load_profile(name)  # fail before binding anything
    specs = fleet.plan(args.n, profiles, args.base_port, args.shared_port, args.model)
    out = Path(args.config_out) if args.config_out else laneway_home() / "emulated.yaml"
    fleet.write_config(specs, args.host, args.shared_port, out)
    dilation = f", time dilated {args.time_dilation:g}x" if args.time_dilation != 1 else ""
    print(f"{args.n} emulated backends ({','.join(profiles)}{dilation}); laneway config: "
          f"{out}", flush=True)
    fleet.run(specs, args.host, args.shared_port, args.processes, args.time_dilation)
    return 0


def _profiles(args: argparse.Namespace) -> int:
    from bench.emulator.profile import available_profiles, load_profile

    for name in available_profiles():
        profile = load_profile(name)
        print(f"{name:22} {profile.model:36} {profile.description}")
    return 0


def _gpu_profiles(args: argparse.Namespace) -> int:
    from bench.emulator.gpu import GPUS, derive, expert_profiles
    from bench.emulator.profile import dump_profile, profile_path

    for profile in [derive(gpu) for gpu in GPUS] + expert_profiles():
        dump_profile(profile, profile_path(profile.name))
        step = profile.step
        context = step.read_context(1024)
        print(f"{profile.name:22} decode 1 seq {step.seconds(1, 1, context, 1024) * 1e3:6.2f} ms, "
              f"prefill 1024 {step.seconds(1024, 1, context, 1024 * 1025 // 2) * 1e3:6.1f} ms, "
              f"KV {profile.kv_tokens:,} tokens")
    return 0


def _fit(args: argparse.Namespace) -> int:
    from bench.emulator import calibrate, fit
    from bench.emulator.profile import dump_profile, profile_path

    out = Path(args.out) if args.out else profile_path(f"tiny-llama-{args.variant}")
    with calibrate.real_server(args.variant, args.url, args.served_model,
                               args.api_server_pid) as (url, pid):
        floor = calibrate.emulator_floor_s()
        profile = fit.fit(url, args.served_model, out.stem, args.rounds, floor,
                          calibrate.MAX_MODEL_LEN, pid)
    dump_profile(profile, out)
    print(f"wrote {out}: {profile.step.model_dump()}, "
          f"request_overhead_s={profile.request_overhead_s:.5f} "
          f"request_latency_s={profile.request_latency_s:.5f}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from bench.emulator import calibrate

    load = calibrate.CheckLoad(args.prompt_tokens, args.output_tokens,
                               args.requests_per_worker, args.passes)
    return calibrate.run(args.variants.split(","), args.refit, args.url, args.served_model,
                         Path(args.out), args.threshold, load, args.rounds,
                         args.api_server_pid)


def _capacity(args: argparse.Namespace) -> int:
    from bench.emulator import capacity

    return capacity.run(args.n, args.profile, args.processes,
                        [float(r) for r in args.rates.split(",")], args.duration,
                        args.prompt_tokens, args.output_tokens, Path(args.out))


PID_HELP = ("with --url: the pid of that server's API-server process, whose CPU per request "
            "and per chunk the fit measures (else the share of the request overhead that is "
            "its CPU is fitted to the burst probes, and chunks cost nothing)")


def add_cli(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "emulate", help="emulated vLLM backends (no model) for fleet-scale tests",
        description="Serve N emulated vLLM instances until Ctrl-C; or a subcommand.")
    parser.add_argument("--n", type=int, default=4, help="instances")
    parser.add_argument("--profile", default="h100-80gb",
                        help="profile names or YAML paths, comma-separated, cycled")
    parser.add_argument("--model", help="served model name (default: the profile's)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--base-port", type=int, default=9000,
                        help="instance i listens on base-port + i (or all on it, shared)")
    parser.add_argument("--shared-port", action="store_true",
                        help="one port; instance emu-i answers under /emu-i/...")
    parser.add_argument("--processes", type=int, default=1,
                        help="split the instances over this many processes")
    parser.add_argument("--config-out", help="laneway config listing the instances "
                        "(default: $LANEWAY_HOME/emulated.yaml)")
    parser.add_argument("--time-dilation", type=float, default=1.0,
                        help="every step and API-server cost this many times longer: a "
                        "fleet too big for this machine at real speed, run slower (send "
                        "arrivals this many times sparser)")
    parser.set_defaults(func=_run)
    sub = parser.add_subparsers(dest="emulate_command")
    sub.add_parser("profiles", help="list the profiles").set_defaults(func=_profiles)
    sub.add_parser("gpu-profiles", help="(re)write the GPU profiles from bench/emulator/gpu.py"
                   ).set_defaults(func=_gpu_profiles)

    fit_cmd = sub.add_parser("fit", help="fit a tiny-llama profile on a real vLLM-CPU server")
    fit_cmd.add_argument("--variant", default="small")
    fit_cmd.add_argument("--out", help="default: bench/emulator/profiles/tiny-llama-<variant>.yaml")
    fit_cmd.add_argument("--url", help="use this running server instead of starting one")
    fit_cmd.add_argument("--served-model", default="tiny-llama", help="its model name")
    fit_cmd.add_argument("--api-server-pid", type=int, help=PID_HELP)
    fit_cmd.add_argument("--rounds", type=int, default=8, help="waves per probe")
    fit_cmd.set_defaults(func=_fit)

    cal = sub.add_parser("calibrate", help="emulator vs real vLLM-CPU: TTFT/TPOT errors")
    cal.add_argument("--variants", default="small")
    cal.add_argument("--refit", action="store_true", help="fit the profile first (same server)")
    cal.add_argument("--url", help="use this running server instead of starting one")
    cal.add_argument("--served-model", default="tiny-llama", help="its model name")
    cal.add_argument("--api-server-pid", type=int, help=PID_HELP)
    cal.add_argument("--out", default=str(REPO / "docs/results/emulator_calibration.json"))
    cal.add_argument("--threshold", type=float, default=0.15)
    cal.add_argument("--prompt-tokens", type=int, default=256)
    cal.add_argument("--output-tokens", type=int, default=64)
    cal.add_argument("--requests-per-worker", type=int, default=4)
    cal.add_argument("--passes", type=int, default=6)
    cal.add_argument("--rounds", type=int, default=6, help="fit: waves per probe")
    cal.set_defaults(func=_calibrate)

    cap = sub.add_parser("capacity", help="requests/s one emulator process sustains")
    cap.add_argument("--n", type=int, default=512, help="instances")
    cap.add_argument("--profile", default="h100-80gb")
    cap.add_argument("--processes", type=int, default=1)
    cap.add_argument("--rates", default="50,100,200,400", help="offered requests/s")
    cap.add_argument("--duration", type=float, default=10.0, help="seconds per rate")
    cap.add_argument("--prompt-tokens", type=int, default=128)
    cap.add_argument("--output-tokens", type=int, default=32)
    cap.add_argument("--out", default=str(REPO / "docs/results/emulator_capacity.json"))
    cap.set_defaults(func=_capacity)

