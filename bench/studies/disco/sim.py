"""Offline simulator of DiSCo (docs/disco.md) over the policy's own planners.

For each device profile (the paper's §5.1 phone measurements), server TTFT
distribution (lognormal brackets), constrained side (DiSCo-D, DiSCo-S), budget b and
seed, every strategy sees the same draws (paired): the same prompts, server TTFTs,
migration TTFTs and uniforms. The tables come from `policies.disco.planner` fed the
way the live policy feeds them: F from a window of server TTFTs (a separate sample of
the same distribution), p(l) from the window of prompt lengths.

    python -m bench.studies.disco.sim [--shared datasets] [--seeds 10] [--out docs/results]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from policies.disco.cost import Costs, Side, TokenCost, constrained_side, unified
from policies.disco.distributions import Floats, kaplan_meier
from policies.disco.planner import LengthMass, device_plan, server_plan
from policies.disco.playback import consumption_times, should_migrate
from predictors.home import DATASETS, open_text

Bools = npt.NDArray[np.bool_]
BUDGETS = tuple(round(0.1 * i, 1) for i in range(11))
HEADLINE_BUDGETS = (0.1, 0.3, 0.5)
STRATEGIES = ("disco", "disco_no_migration", "stoch", "server_only", "device_only")
TOKENS_PER_WORD = 1.3
OUTPUT_CAP = 128  # the paper's generation limit (Appendix E)
DEVICE_WATTS = 5.0  # assumed phone draw while running the model: J/token = W / tokens/s
SERVER_PRICE = TokenCost(0.15, 0.60)  # GPT-4o-mini, $ per 1M tokens (Table 8)
RATES: dict[Side, float] = {"device": 5.0, "server": 0.3}  # λ per constraint (App. E)


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """Measured phone speeds the paper quotes in §5.1 (from Li et al. 2024b)."""

    name: str
    prefill_tps: float
    decode_tps: float
    overhead_s: float = 0.1  # T_d's c: tokenisation and launch

    def joules(self) -> TokenCost:
        return TokenCost(DEVICE_WATTS / self.prefill_tps, DEVICE_WATTS / self.decode_tps)


@dataclass(frozen=True, slots=True)
class ServerTtft:
    """Server TTFT ~ lognormal(median, sigma): network + queue + prefill, no length
    dependence (the paper's Table 1)."""

    name: str
    median_s: float
    sigma: float
    decode_tps: float = 50.0

    def draw(self, rng: np.random.Generator, n: int) -> Floats:
        return rng.lognormal(math.log(self.median_s), self.sigma, n)


@dataclass(frozen=True, slots=True)
class EmpiricalTtft:
    """Server TTFTs drawn (with replacement) from measured ones: the Mooncake trace
    replayed on an emulated fleet near saturation (bench/studies/disco/mooncake_ttft.py)."""

    name: str
    samples: tuple[float, ...]
    decode_tps: float = 50.0

    def draw(self, rng: np.random.Generator, n: int) -> Floats:
        return rng.choice(np.asarray(self.samples), n)

    @classmethod
    def load(cls, path: Path) -> EmpiricalTtft:
        return cls("mooncake-emulated", tuple(json.loads(path.read_text())["ttft_s"]))


TtftSource = ServerTtft | EmpiricalTtft
MOONCAKE_TTFT = Path("docs/results/disco_mooncake_ttft.json")


PROFILES = (DeviceProfile("pixel7pro-bloom-1.1b", 31.32, 13.93),
            DeviceProfile("pixel7pro-bloom-560m", 51.80, 20.14),
            DeviceProfile("xiaomi14-qwen1.5-0.5b", 79.90, 21.47))
SERVERS = (ServerTtft("lognormal-fast", 0.35, 0.5),
           ServerTtft("lognormal-mid", 0.7, 0.8),
           ServerTtft("lognormal-heavy", 1.0, 1.2))


@dataclass(frozen=True, slots=True)
class Workload:
    prompt_tokens: Floats
    output_tokens: npt.NDArray[np.int64]


def load_workload(shared: Path) -> Workload:
    """Alpaca-eval instructions (prompts) and references (answers), tokens ≈ words·1.3."""
    prompts, outputs = [], []
    with open_text(shared / "data" / "alpaca_eval_experts.jsonl") as lines:
        for line in lines:
            row = json.loads(line)
            prompts.append(max(1, round(len(row["instruction"].split()) * TOKENS_PER_WORD)))
            outputs.append(min(OUTPUT_CAP, max(2, round(len(row["reference"].split())
                                                        * TOKENS_PER_WORD))))
    return Workload(np.asarray(prompts, dtype=np.float64), np.asarray(outputs))


@dataclass(frozen=True, slots=True)
class Draws:
    """One seed's randomness, shared by every strategy and budget."""

    prompt: Floats
    output: npt.NDArray[np.int64]
    server_ttft: Floats  # the first server leg's TTFT
    migration_ttft: Floats  # the server's TTFT when a stream migrates to it
    uniform: Floats  # Stoch's coin and Algorithm 3's boundary draw
    ttft_window: Floats  # what the policy's F window holds (same distribution)


def make_draws(workload: Workload, server: TtftSource, seed: int, requests: int,
               window: int) -> Draws:
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(workload.prompt_tokens), requests)
    return Draws(workload.prompt_tokens[pick], workload.output_tokens[pick],
                 server.draw(rng, requests), server.draw(rng, requests),
                 rng.random(requests), server.draw(rng, window))


@dataclass(frozen=True, slots=True)
class Run:
    ttft_mean_s: float
    ttft_p99_s: float
    budget_used: float  # the constrained side's share of prompt tokens
    device_share: float
    server_share: float
    cost_usd_per_1k: float
    migrated_share: float
    tbt_p99_s: float | None  # over the migrated streams, as the reader sees it
    delayed_tokens_p99: float | None


@dataclass(frozen=True, slots=True)
class Scenario:
    profile: DeviceProfile
    server: TtftSource
    constrained: Side
    read_rate: float
    tail_ratio: float
    migration_quantile: float

    def costs(self) -> Costs:
        return unified(SERVER_PRICE, self.profile.joules(), RATES[self.constrained])

    def device_ttft(self, tokens: Floats) -> Floats:
        return tokens / self.profile.prefill_tps + self.profile.overhead_s


def legs(scenario: Scenario, strategy: str, budget: float,
         draws: Draws) -> tuple[Bools, Bools, Floats, Floats]:
    """Which legs start, and when: (device runs, server runs, device start, server start)."""
    n = len(draws.prompt)
    always, never = np.ones(n, dtype=bool), np.zeros(n, dtype=bool)
    zero = np.zeros(n)
    if strategy == "server_only":
        return never, always, zero, zero
    if strategy == "device_only":
        return always, never, zero, zero
    mass = LengthMass.of(np.sort(draws.prompt))
    if scenario.constrained == "device":
        if strategy == "stoch":
            wait = np.where(draws.uniform < budget, 0.0, math.inf)
        else:
            ecdf = kaplan_meier(draws.ttft_window, np.zeros(len(draws.ttft_window), bool))
            table = device_plan(mass, ecdf, scenario.tail_ratio, budget)
            wait = np.array([table.wait(tokens) for tokens in draws.prompt.tolist()])
        started = draws.server_ttft > wait  # no server token by w(l)
        return started, always, np.where(started, wait, 0.0), zero
    if strategy == "stoch":
        raced = draws.uniform < budget
    else:
        races = server_plan(mass, budget)
        share = np.array([races.race_share(tokens) for tokens in draws.prompt.tolist()])
        raced = draws.uniform < share
    return always, raced, zero, zero


def simulate(scenario: Scenario, strategy: str, budget: float, draws: Draws) -> Run:
    device_on, server_on, device_at, _ = legs(scenario, strategy, budget, draws)
    device_first = np.where(device_on, device_at + scenario.device_ttft(draws.prompt),
                            math.inf)
    server_first = np.where(server_on, draws.server_ttft, math.inf)
    ttft = np.minimum(device_first, server_first)
    device_won = device_first < server_first
    tokens = draws.prompt
    total = float(tokens.sum())
    device_share = float(tokens[device_on].sum()) / total
    server_share = float(tokens[server_on].sum()) / total
    costs = scenario.costs()
    prefill = (costs.device.prefill * tokens * device_on
               + costs.server.prefill * tokens * server_on)
    decode_rate = np.where(device_won, costs.device.decode, costs.server.decode)
    cost = prefill + decode_rate * draws.output
    migrated_share, tbt, delayed = 0.0, None, None
    if strategy == "disco":
        cost, migrated, tbt, delayed = migrate(scenario, draws, ttft, device_won, cost)
        migrated_share = float(migrated.mean())
    return Run(float(ttft.mean()), float(np.quantile(ttft, 0.99)),
               device_share if scenario.constrained == "device" else server_share,
               device_share, server_share, float(cost.mean()) / 1e6 * 1000,
               migrated_share, tbt, delayed)


def migrate(scenario: Scenario, draws: Draws, ttft: Floats, device_won: Bools,
            cost: Floats) -> tuple[Floats, Bools, float | None, float | None]:
    """Token-level migration to the cheaper decoder (Eq. 4-6), all streams at once:
    the source streams until the reader holds B tokens, then the target re-prefills
    the prompt and the answer so far and continues. Returns the costs, which streams
    moved, and over the moved ones the reader's TBT p99 and delayed tokens p99."""
    src_rate = np.where(device_won, scenario.profile.decode_tps, scenario.server.decode_tps)
    tgt_rate = np.where(device_won, scenario.server.decode_tps, scenario.profile.decode_tps)
    last = handover_token(scenario, draws, device_won, src_rate)
    migrated = wants_to_move(scenario, draws, device_won) & (last + 1 < draws.output)
    if not migrated.any():
        return cost, migrated, None, None
    rows = np.flatnonzero(migrated)
    k = last[rows].astype(np.float64)
    length = draws.output[rows]
    context = draws.prompt[rows] + k + 1  # what the target re-prefills
    target_ttft = np.where(device_won[rows], draws.migration_ttft[rows],
                           scenario.device_ttft(context))
    index = np.arange(OUTPUT_CAP, dtype=np.float64)
    after = index[None, :] - k[:, None] - 1  # tokens into the target's run
    arrivals = np.where(
        after < 0, ttft[rows, None] + index[None, :] / src_rate[rows, None],
        (ttft[rows] + k / src_rate[rows] + target_ttft)[:, None]
        + after / tgt_rate[rows, None])
    arrivals = np.where(index[None, :] < length[:, None], arrivals,
                        arrivals[np.arange(len(rows)), length - 1][:, None])
    gaps = np.diff(consumption_times(arrivals, scenario.read_rate), axis=1)
    valid = index[None, 1:] < length[:, None]
    pace = 1.0 / scenario.read_rate if scenario.read_rate > 0 else math.inf
    delayed = ((gaps > pace + 1e-9) & valid).sum(axis=1)
    moved = cost.copy()
    moved[rows] += moved_cost(scenario.costs(), device_won[rows], k, length, context)
    return (moved, migrated, float(np.quantile(gaps[valid], 0.99)),
            float(np.quantile(delayed, 0.99)))


def wants_to_move(scenario: Scenario, draws: Draws, device_won: Bools) -> Bools:
    """Eq. 4-5 at the first token; l_remaining is the mean answer (no predictor)."""
    costs, expected = scenario.costs(), float(draws.output.mean())
    return np.array([should_migrate(costs.device if won else costs.server,
                                    costs.server if won else costs.device,
                                    expected - 1, tokens + 1)
                     for won, tokens in zip(device_won.tolist(), draws.prompt.tolist(),
                                            strict=True)], dtype=bool)


def handover_token(scenario: Scenario, draws: Draws, device_won: Bools,
                   src_rate: Floats) -> npt.NDArray[np.intp]:
    """Per stream, the index of the source's last token: the first at which the reader
    holds B = r_c·t_m unread (Eq. 6); OUTPUT_CAP when it never does. Sources decode
    faster than r_c, so the reader keeps pace: k tokens after the first, k -
    floor(k·r_c/r_src) are unread."""
    index = np.arange(OUTPUT_CAP, dtype=np.float64)[None, :]
    if scenario.read_rate > 0.0:
        unread = index - np.floor(index * scenario.read_rate / src_rate[:, None] + 1e-9)
    else:
        unread = np.zeros((len(src_rate), OUTPUT_CAP))
    ecdf = kaplan_meier(draws.ttft_window, np.zeros(len(draws.ttft_window), bool))
    server_t_m = ecdf.quantile(scenario.migration_quantile)
    device_t_m = scenario.device_ttft(draws.prompt[:, None] + index + 1)
    t_m = np.where(device_won[:, None], server_t_m, device_t_m)
    ready = unread >= scenario.read_rate * t_m
    last: npt.NDArray[np.intp] = np.where(ready.any(axis=1), np.argmax(ready, axis=1),
                                          OUTPUT_CAP)
    return last


def moved_cost(costs: Costs, device_won: Bools, k: Floats, length: npt.NDArray[np.int64],
               context: Floats) -> Floats:
    """What a move adds ($ per 1M tokens): the tokens after the handover decode on the
    target instead of the source, and the target re-prefills the context."""
    src_decode = np.where(device_won, costs.device.decode, costs.server.decode)
    tgt_prefill = np.where(device_won, costs.server.prefill, costs.device.prefill)
    tgt_decode = np.where(device_won, costs.server.decode, costs.device.decode)
    rest = length - k - 1
    added: Floats = tgt_prefill * context + (tgt_decode - src_decode) * rest
    return added


def run_grid(workload: Workload, *, seeds: int, requests: int, window: int,
             budgets: tuple[float, ...], profiles: tuple[DeviceProfile, ...],
             servers: tuple[TtftSource, ...], read_rate: float = 5.0,
             tail_ratio: float = 0.05, migration_quantile: float = 0.9
             ) -> list[dict[str, Any]]:
    """Every cell averaged over seeds."""
    cells: list[dict[str, Any]] = []
    for profile in profiles:
        for server in servers:
            all_draws = [make_draws(workload, server, seed, requests, window)
                         for seed in range(seeds)]
            for side in ("device", "server"):
                scenario = Scenario(profile, server, side, read_rate, tail_ratio,
                                    migration_quantile)
                for budget in budgets:
                    for strategy in STRATEGIES:
                        runs = [simulate(scenario, strategy, budget, draws)
                                for draws in all_draws]
                        cells.append({"profile": profile.name, "server_ttft": server.name,
                                      "constrained": side, "strategy": strategy,
                                      "budget": budget, **mean_run(runs)})
    return cells


def mean_run(runs: list[Run]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in asdict(runs[0]):
        values = [v for v in (getattr(r, key) for r in runs) if v is not None]
        out[key] = float(np.mean(values)) if values else None
    return out


def reduction(ours: float, best: float) -> float:
    return 1.0 - ours / best if best > 0 else 0.0


def summarize(cells: list[dict[str, Any]], servers: set[str] | None = None
              ) -> dict[str, Any]:
    """The issue's headline fields: per constrained side, means over profiles, server
    distributions (`servers`; None: all) and b in HEADLINE_BUDGETS. The best baseline at
    a budget b is the better of Stoch at b and the unconstrained side alone (which spends
    nothing)."""
    cells = [c for c in cells if servers is None or c["server_ttft"] in servers]
    index = {(c["profile"], c["server_ttft"], c["constrained"], c["strategy"],
              c["budget"]): c for c in cells}
    out: dict[str, Any] = {}
    for side, label in (("device", "disco_d"), ("server", "disco_s")):
        alone = "server_only" if side == "device" else "device_only"
        p99s, means, costs = [], [], []
        for (profile, server, constrained, strategy, budget), cell in index.items():
            if constrained != side or strategy != "disco":
                continue
            key = (profile, server, side)
            plain = index[(*key, "disco_no_migration", budget)]
            costs.append(reduction(cell["cost_usd_per_1k"], plain["cost_usd_per_1k"]))
            if budget not in HEADLINE_BUDGETS:
                continue
            rivals = [index[(*key, "stoch", budget)], index[(*key, alone, budget)]]
            p99s.append(reduction(cell["ttft_p99_s"], min(r["ttft_p99_s"] for r in rivals)))
            means.append(reduction(cell["ttft_mean_s"],
                                   min(r["ttft_mean_s"] for r in rivals)))
        tbt = [c["tbt_p99_s"] for c in cells if c["constrained"] == side
               and c["strategy"] == "disco" and c["tbt_p99_s"] is not None]
        delayed = [c["delayed_tokens_p99"] for c in cells if c["constrained"] == side
                   and c["strategy"] == "disco" and c["delayed_tokens_p99"] is not None]
        out[label] = {
            "ttft_p99_reduction_vs_best_baseline": float(np.mean(p99s)),
            "ttft_mean_reduction_vs_best_baseline": float(np.mean(means)),
            "ttft_p99_reduction_range": [float(np.min(p99s)), float(np.max(p99s))],
            "cost_reduction_from_migration": float(np.mean(costs)),
            "cost_reduction_from_migration_max": float(np.max(costs)),
            "playback_tbt_p99_s": float(np.max(tbt)) if tbt else None,
            "delayed_tokens_p99": float(np.max(delayed)) if delayed else None,
        }
    return out


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(summary: dict[str, Any], cells: list[dict[str, Any]], setup: dict[str, Any],
             by_server: dict[str, dict[str, Any]] | None = None) -> str:
    lines = ["# DiSCo offline simulation", "",
             f"`{setup['command']}` at `{setup['commit'][:12]}`; {setup['seeds']} seeds x "
             f"{setup['requests']} requests per cell; docs/disco.md has the setup.", "",
             "| | DiSCo-D | DiSCo-S |", "|---|---|---|"]
    for key in ("ttft_p99_reduction_vs_best_baseline", "ttft_mean_reduction_vs_best_baseline",
                "cost_reduction_from_migration", "cost_reduction_from_migration_max",
                "playback_tbt_p99_s", "delayed_tokens_p99"):
        d, s = summary["disco_d"][key], summary["disco_s"][key]
        lines.append(f"| {key} | {_fmt(d)} | {_fmt(s)} |")
    if by_server:
        lines += ["", "Per server TTFT distribution (DiSCo-D / DiSCo-S):", "",
                  "| server | p99 reduction | mean reduction | cost cut by migration |",
                  "|---|---|---|---|"]
        for name, part in by_server.items():
            cols = [f"{_fmt(part['disco_d'][k])} / {_fmt(part['disco_s'][k])}"
                    for k in ("ttft_p99_reduction_vs_best_baseline",
                              "ttft_mean_reduction_vs_best_baseline",
                              "cost_reduction_from_migration")]
            lines.append(f"| {name} | " + " | ".join(cols) + " |")
    lines += ["", f"pick p99: {_fmt(setup.get('pick_p99_ms'))} ms", "",
              "p99 TTFT (s) at b = 0.1 / 0.3 / 0.5, per profile and server distribution:", "",
              "| constrained | profile | server | disco | stoch | unconstrained alone |",
              "|---|---|---|---|---|---|"]
    index = {(c["profile"], c["server_ttft"], c["constrained"], c["strategy"],
              c["budget"]): c for c in cells}
    for side in ("device", "server"):
        alone = "server_only" if side == "device" else "device_only"
        for profile in setup["profiles"]:
            for server in setup["servers"]:
                row = [" / ".join(f"{index[(profile, server, side, s, b)]['ttft_p99_s']:.2f}"
                                  for b in HEADLINE_BUDGETS)
                       for s in ("disco", "stoch", alone)]
                lines.append(f"| {side} | {profile} | {server} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def plot(cells: list[dict[str, Any]], path: Path, profile: str, server: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for col, side in enumerate(("device", "server")):
        for row, metric in enumerate(("ttft_mean_s", "ttft_p99_s")):
            ax = axes[row][col]
            for strategy in ("disco", "stoch", "server_only", "device_only"):
                points = sorted((c["budget"], c[metric]) for c in cells
                                if c["profile"] == profile and c["server_ttft"] == server
                                and c["constrained"] == side and c["strategy"] == strategy)
                ax.plot(*zip(*points, strict=True), marker="o", label=strategy)
            ax.set_title(f"{'DiSCo-D' if side == 'device' else 'DiSCo-S'}: {metric}")
            ax.set_xlabel("budget b")
            ax.set_ylabel("seconds")
    axes[0][0].legend()
    fig.suptitle(f"{profile}, server {server}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--shared", type=Path, default=DATASETS)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=805)
    parser.add_argument("--window", type=int, default=2000, help="F window (TTFTs)")
    parser.add_argument("--read-rate", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--mooncake-ttft", type=Path, default=MOONCAKE_TTFT,
                        help="also the TTFTs bench/studies/disco/mooncake_ttft.py derived "
                        "(reported apart from the lognormal brackets' headline)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    workload = load_workload(args.shared)
    servers: tuple[TtftSource, ...] = SERVERS
    if args.mooncake_ttft.exists():
        servers += (EmpiricalTtft.load(args.mooncake_ttft),)
    cells = run_grid(workload, seeds=args.seeds, requests=args.requests, window=args.window,
                     budgets=BUDGETS, profiles=PROFILES, servers=servers,
                     read_rate=args.read_rate)
    from bench.studies.disco.pick_latency import pick_latency

    setup = {"command": " ".join(["python -m bench.studies.disco.sim", *(argv or sys.argv[1:])]),
             "commit": commit(), "seeds": args.seeds, "requests": args.requests,
             "window": args.window, "read_rate": args.read_rate, "budgets": list(BUDGETS),
             "profiles": [p.name for p in PROFILES], "servers": [s.name for s in servers],
             "algorithm_1_says": {p.name: {side: constrained_side(unified(
                 SERVER_PRICE, p.joules(), RATES[side])) for side in RATES}
                 for p in PROFILES},
             "pick_p99_ms": pick_latency()["pick_p99_ms"]}
    # the headline keeps to the lognormal brackets (as before F from Mooncake existed);
    # each server distribution also on its own
    summary = summarize(cells, {s.name for s in SERVERS})
    by_server = {s.name: summarize(cells, {s.name}) for s in servers}
    setup["seconds"] = round(time.perf_counter() - started, 1)
    headline = {key: {side: summary[side][key] for side in summary}
                for key in summary["disco_d"]}
    result = {**setup, **headline, "by_server_ttft": by_server, "cells": cells}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "disco_sim.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "disco_sim.md").write_text(markdown(summary, cells, setup, by_server))
    if not args.no_plots:
        plot(cells, args.out / "disco_sim_ttft.png", PROFILES[0].name, SERVERS[1].name)
    print(json.dumps({**setup, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
