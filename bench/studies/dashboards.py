"""The Grafana dashboards' PromQL, run against a real Prometheus: check that every
panel returns data, and render a dashboard to PNG with matplotlib (no Grafana here).

    python -m bench.studies.dashboards check  --prometheus http://127.0.0.1:9090
    python -m bench.studies.dashboards render --prometheus http://127.0.0.1:9090 --out overview.png
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

DASHBOARDS = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards"
OVERVIEW = DASHBOARDS / "laneway-overview.json"


@dataclass(frozen=True, slots=True)
class PanelQuery:
    panel: str
    ref: str
    expr: str
    legend: str


def panel_queries(dashboard: Path = OVERVIEW) -> list[PanelQuery]:
    data = json.loads(dashboard.read_text())
    return [PanelQuery(p["title"], t["refId"], t["expr"], t.get("legendFormat", ""))
            for p in data["panels"] for t in p.get("targets", ())]


def promql(expr: str, rate_interval: str = "1m") -> str:
    """Grafana's `$__rate_interval` as a fixed window (Grafana computes it per zoom)."""
    return expr.replace("$__rate_interval", rate_interval)


def instant(prometheus: str, expr: str, rate_interval: str = "1m") -> list[dict[str, Any]]:
    response = httpx.get(f"{prometheus}/api/v1/query",
                         params={"query": promql(expr, rate_interval)}, timeout=10)
    response.raise_for_status()
    body = response.json()
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def empty_panels(prometheus: str, dashboard: Path = OVERVIEW,
                 rate_interval: str = "1m") -> list[PanelQuery]:
    """The queries that return no series (or only NaN: a quantile of no events)."""
    def has_data(result: list[dict[str, Any]]) -> bool:
        return any(r["value"][1] not in ("NaN", "+Inf", "-Inf") for r in result)

    return [q for q in panel_queries(dashboard)
            if not has_data(instant(prometheus, q.expr, rate_interval))]


def peaks(prometheus: str, start: float, end: float, dashboard: Path = OVERVIEW,
          rate_interval: str = "1m") -> dict[PanelQuery, float | None]:
    """Each query's largest finite value between `start` and `end` (None: no data)."""
    found: dict[PanelQuery, float | None] = {}
    for query in panel_queries(dashboard):
        values = [float(v) for series in _range(prometheus, promql(query.expr, rate_interval),
                                                start, end)
                  for _, v in series["values"] if v not in ("NaN", "+Inf", "-Inf")]
        found[query] = max(values) if values else None
    return found


def render(prometheus: str, out: Path, dashboard: Path = OVERVIEW, minutes: float = 10,
           rate_interval: str = "1m") -> Path:
    """Every panel of `dashboard` as a matplotlib subplot over the last `minutes`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(dashboard.read_text())
    panels = data["panels"]
    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(14, 2.6 * rows), squeeze=False)
    end = time.time()
    start = end - minutes * 60
    for ax, panel in zip(axes.flat, panels, strict=False):
        for target in panel.get("targets", ()):
            for series in _range(prometheus, promql(target["expr"], rate_interval), start, end):
                xs = [(float(t) - end) / 60 for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                ax.plot(xs, ys, linewidth=1.2,
                        label=_legend(target.get("legendFormat", ""), series["metric"]))
        ax.set_title(panel["title"], fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("minutes", fontsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(data["title"])
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _range(prometheus: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    response = httpx.get(f"{prometheus}/api/v1/query_range", params={
        "query": expr, "start": start, "end": end, "step": max(1.0, (end - start) / 200)},
        timeout=20)
    response.raise_for_status()
    result: list[dict[str, Any]] = response.json()["data"]["result"]
    return result


def _legend(fmt: str, labels: dict[str, str]) -> str:
    for key, value in labels.items():
        fmt = fmt.replace("{{" + key + "}}", value)
    return fmt.replace("{{", "").replace("}}", "") or str(labels)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("command", choices=["check", "render"])
    parser.add_argument("--prometheus", required=True)
    parser.add_argument("--dashboard", type=Path, default=OVERVIEW)
    parser.add_argument("--out", type=Path, default=Path("laneway-overview.png"))
    parser.add_argument("--minutes", type=float, default=10)
    args = parser.parse_args(argv)
    if args.command == "check":
        empty = empty_panels(args.prometheus, args.dashboard)
        for q in empty:
            print(f"no data: {q.panel} [{q.ref}] {q.expr}")
        print(f"{len(panel_queries(args.dashboard)) - len(empty)} queries with data, "
              f"{len(empty)} without")
    else:
        print(render(args.prometheus, args.out, args.dashboard, args.minutes))


if __name__ == "__main__":
    main()
