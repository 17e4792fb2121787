"""Benchmark tables generated from the result files in `docs/results/`.

An MkDocs hook (`mkdocs.yml`, `hooks:`): a page's `<!-- results-table: KIND [ARG] -->`
becomes a table read from the latest run's JSON, so the figures on the site are the
ones in the files, never copied by hand. Kinds:

* `files`: every result file at the top of `docs/results/` with its command and commit;
* `overhead`, `peers`, `policy-latency`, `scale-decisions`, `goodput-headline`: one
  benchmark's table;
* `policies FLEET`: every baseline policy on one fleet (`docs/results/policies/FLEET/`);
* `policy NAME`: one policy's rows of the baseline-policy and decision-latency runs.

`python docs/gen_results_tables.py KIND [ARG]` prints one.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MARKER = "<!-- results-table: "
SCALES = ("1", "1.5", "2", "2.5", "3")
FLEETS = ("emulated-64", "real-small-small-large")
X = "\u00d7"  # the multiplication sign of a ratio, as the pages write it


def _load(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _source(name: str, data: dict[str, Any]) -> str:
    commit = str(data.get("commit") or "")[:7]
    return f"\n\n(`docs/results/{name}`{', commit ' + commit if commit else ''})"


def files() -> str:
    rows = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        data = data if isinstance(data, dict) else {}
        command = " ".join(str(data.get("command") or "").split())
        rows.append([f"`{path.name}`", f"`{command}`" if command else "",
                     str(data.get("commit") or "")[:7]])
    return _table(["file", "command", "commit"], rows)


def overhead() -> str:
    data = _load("overhead.json")
    targets = data["targets"]
    rows = [[f"{label} {q}", f"{data[key][f'direct_{q}_ms']:.2f} ms",
             f"{data[key][f'target_{q}_ms']:.2f} ms", f"+{data[key][f'added_{q}_ms']:.2f} ms",
             f"≤ +{targets[f'added_{q}_ms']:g} ms"]
            for key, label in (("non_stream", "non-streamed latency"), ("ttft", "streamed TTFT"))
            for q in ("p50", "p99")]
    for streams, run in data["streaming"].items():
        target = targets["throughput_ratio_256"] if streams == "256" else None
        rows.append([f"{streams} {X} {data['plan']['tokens']} tokens @ {data['plan']['tpot_ms']:g} "
                     "ms/token", f"{run['direct_tokens_per_s']:.0f} tok/s",
                     f"{run['target_tokens_per_s']:.0f} tok/s", f"{run['ratio']:.3f}{X}",
                     f"≥ {target}{X}" if target else ""])
    return _table(["measure", "direct", "via laneway", "added / ratio", "target"], rows) + \
        _source("overhead.json", data)


def peers() -> str:
    data = _load("peers.json")

    def added(r: dict[str, Any], measure: str) -> str:
        return f"{r[measure + '_added_p50_ms']:+.2f} / {r[measure + '_added_p99_ms']:+.2f}"
    rows = [[name, str(i + 1), added(r, "non_stream"), added(r, "ttft"),
             f"{r['ratio_64']:.3f}{X} ({r['cpu_us_per_token_64']:.0f} µs)",
             f"{r['ratio_256']:.3f}{X} ({r['cpu_us_per_token_256']:.0f} µs)",
             str(r["failed_streams_256"])]
            for name, runs in data["summary"].items() for i, r in enumerate(runs)]
    header = ["router", "round", "non-streamed added p50 / p99 ms", "TTFT added p50 / p99 ms",
              "64 streams: ratio (CPU/token)", "256 streams: ratio (CPU/token)",
              "failed streams @256"]
    return _table(header, rows) + _source("peers.json", data)


def scale_decisions(policy: str | None = None) -> str:
    data = _load("scale.json")
    rows = [[f"`{d['policy']}`", str(d["backends"]), f"{d['p50_us']:.1f}", f"{d['p99_us']:.1f}"]
            for d in data["decisions"] if policy is None or d["policy"] == policy]
    return _table(["policy", "backends", "decision p50 µs", "p99 µs"], rows) + \
        _source("scale.json", data)


def policy_latency(policy: str | None = None) -> str:
    """`pick` CPU time per policy at each fleet size (`make bench STUDY=policy-latency`)."""
    picks = [d for d in _load("policy_latency.json") if policy is None or d["policy"] == policy]
    sizes = sorted({d["backends"] for d in picks})
    by_policy: dict[str, dict[int, dict[str, Any]]] = {}
    for d in picks:
        by_policy.setdefault(d["policy"], {})[d["backends"]] = d
    rows = [[f"`{name}`"] + [f"{runs[n]['p50_us']:.1f} / {runs[n]['p99_us']:.1f} µs"
                             if n in runs else "" for n in sizes]
            for name, runs in by_policy.items()]
    return _table(["policy"] + [f"p50 / p99 at {n}" for n in sizes], rows) + \
        "\n\n(`docs/results/policy_latency.json`)"


def _policy_row(run: dict[str, Any]) -> list[str]:
    def ms(values: list[float]) -> str:
        return f"{values[0] * 1000:.0f} / {values[2] * 1000:.0f}"
    attain = " / ".join(f"{s['attainment'] * 100:.0f}" for s in run["slo"])
    return [f"`{run['name']}`", f"{run['throughput_rps']:.2f}", ms(run["ttft_s"]),
            ms(run["tpot_s"]), f"{run['e2e_s'][0]:.2f} / {run['e2e_s'][2]:.2f}", attain + " %"]


POLICY_HEADER = ["policy", "req/s", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms",
                 "E2E p50 / p99 s", "SLO attainment @1 / 1.5 / 2 / 2.5 / 3"]


def policies(fleet: str) -> str:
    runs = _load(f"policies/{fleet}/summary.json")
    return _table(POLICY_HEADER, [_policy_row(r) for r in runs]) + \
        f"\n\n(`docs/results/policies/{fleet}/summary.json`)"


def policy(name: str) -> str:
    rows = [[fleet, *_policy_row(r)] for fleet in FLEETS
            for r in _load(f"policies/{fleet}/summary.json") if r["name"] == name]
    out = _table(["fleet", *POLICY_HEADER], rows) if rows else ""
    source = ", ".join(f"`docs/results/policies/{fleet}/summary.json`" for fleet in FLEETS)
    return (f"{out}\n\n({source})\n\n" if out else "") + policy_latency(name)


def goodput_headline() -> str:
    data = _load("goodput.json")
    fleet = next(f for f in data["fleets"] if f["fleet"] == data["primary_fleet"])
    head = data["headline_variant"]
    per_scale = fleet["variants"][head]["best_baseline_per_scale"]
    ranges = data["goodput_ratio_range"]

    def ratios(values: dict[str, float]) -> list[str]:
        return [f"{values[s]:.2f}{X}" for s in SCALES]
    rows = [
        [f"`{head}`"] + [f"{data['goodput_ratio_vs_best_baseline'][s]:.2f}{X} "
                         f"({ranges[s][0]:.2f}\u2013{ranges[s][1]:.2f})" for s in SCALES],
        ["SLOs met (best baseline)"] + [
            f"{fleet['slo_attainment'][head][s] * 100:.0f} % "
            f"({fleet['slo_attainment'][per_scale[s]][s] * 100:.0f} %)" for s in SCALES],
        ["SLO attainment ratio", *ratios(data["attainment_ratio_vs_best_baseline"])],
        ["Algorithm 1 as written", *ratios(data["algorithm1_ratio_vs_best_baseline"])],
        ["oracle length (Algorithm 1 on the true length)",
         *ratios(fleet["variants"]["goodput-oracle"]["goodput_ratio_vs_best_baseline"])]]
    note = (f"\n\nGoodput over the best baseline, median of the repeats (range), fleet "
            f"`{data['primary_fleet']}`; routing decision p99 at 512 backends "
            f"{data['decision_p99_ms_512']} ms, length predictor p50 "
            f"{data['predictor_p50_ms']} ms.")
    return _table(["SLO scale", *SCALES], rows) + note + _source("goodput.json", data)


KINDS: dict[str, Callable[..., str]] = {
    "files": files, "overhead": overhead, "policy-latency": policy_latency, "peers": peers,
    "scale-decisions": scale_decisions,
    "goodput-headline": goodput_headline, "policies": policies, "policy": policy,
}


def render(spec: str) -> str:
    kind, *args = spec.split()
    return KINDS[kind](*args)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs hook: fill the page's result-table markers."""
    while MARKER in markdown:
        start = markdown.index(MARKER)
        end = markdown.index("-->", start)
        markdown = markdown[:start] + render(markdown[start + len(MARKER):end]) + \
            markdown[end + 3:]
    return markdown


if __name__ == "__main__":
    print(render(" ".join(sys.argv[1:])))
