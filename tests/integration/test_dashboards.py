"""Every Grafana panel's PromQL returns data from a real Prometheus scraping two proxy
replicas and real vLLM-CPU backends, after traffic that exercises each panel: SLOs met
and missed, forced migrations, a backend that always fails (retries, 502s), bad input,
length predictions against the real answers, a pass-through request (`/tokenize`).
The deployment's alerting rules (deploy/prometheus/alerts.yml) load and evaluate there.

LANEWAY_DASHBOARD_PNG=path also renders the overview dashboard there (README image).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bench.harness.services import MissingService, binary, running_fakes
from bench.models.backends import Running
from bench.studies.dashboards import empty_panels, panel_queries, peaks, render
from bench.studies.stack_local import running_stack
from tests.predictors.helpers import tiny_length_artifact

pytestmark = pytest.mark.vllm


def one_wave(http: httpx.Client, proxy_url: str, model: str) -> list[int]:
    """Requests touching every panel; returns their statuses."""
    chat = {"model": model, "max_tokens": 12, "temperature": 0, "stream": True,
            "ignore_eos": True, "messages": [{"role": "user", "content": "Name three colours."}]}
    # Moves: long enough that the stream is still running when the handoff is ready.
    greedy = {**chat, "max_tokens": 64}  # moves by a paced handoff
    sampled = {**greedy, "temperature": 0.8, "seed": 1}  # by a frozen one (a stall)
    calls = [
        (chat, {"x-laneway-slo-ms": "60000"}),  # met
        (chat, {"x-laneway-slo-ms": "1"}),  # missed
        (greedy, {"x-laneway-migrate-after": "4", "x-laneway-events": "1"}),
        (sampled, {"x-laneway-migrate-after": "4", "x-laneway-events": "1"}),
        ({**chat, "stream": False}, {}),
        ({**chat, "model": "flaky"}, {}),  # retried, then 502
        ({"model": model, "messages": "not a list"}, {}),  # 400
    ]
    statuses = []
    for body, headers in calls:
        response = http.post(f"{proxy_url}/v1/chat/completions", json=body, headers=headers)
        statuses.append(response.status_code)
    # A pass-through endpoint's panels (embeddings, tokenize, ...)
    tokenized = http.post(f"{proxy_url}/tokenize", json={"model": model, "prompt": "Name it."})
    # Flow control's panels: a burst larger than the backends' room waits in the proxy.
    with ThreadPoolExecutor(6) as burst:
        held = list(burst.map(lambda _: http.post(
            f"{proxy_url}/v1/chat/completions", json={**chat, "stream": False},
            headers={"x-laneway-priority": "1"}).status_code, range(6)))
    return [*statuses, tokenized.status_code, *held]


def test_every_panel_query_returns_data(vllm_fleet: list[Running], tmp_path: Path) -> None:
    try:
        binary("prometheus")
        binary("redis-server")
    except MissingService as exc:
        pytest.skip(str(exc))
    backends = [{"name": s.name, "url": f"http://127.0.0.1:{s.port}", "model": s.model}
                for s in vllm_fleet]
    model = vllm_fleet[0].model
    with running_fakes(1, "--model", "flaky", "--fail-status", "500") as (flaky,):
        backends.append({"name": "flaky", "url": flaky, "model": "flaky"})
        config = {"debug": {"allow_forced_migration": True},
                  "flow_control": {"max_inflight_per_backend": 2},  # and the predictor's panels:
                  "predictors": {"length": {"artifact": str(tiny_length_artifact(tmp_path))}}}
        with running_stack(backends, config=config) as stack, \
                httpx.Client(timeout=120) as http, ThreadPoolExecutor(4) as pool:
            # Waves a few scrapes apart: a histogram quantile needs its series to exist
            # before the events it counts (a rate over one sample is no rate).
            started = time.time()
            for _ in range(5):
                waves = [pool.submit(one_wave, http, p.url, model) for p in stack.proxies]
                for wave in waves:
                    assert wave.result() == [200, 200, 200, 200, 200, 502, 400, 200] + [200] * 6
                time.sleep(2.0)
            time.sleep(2.5)  # the last wave scraped
            empty = empty_panels(stack.prometheus)
            peak = peaks(stack.prometheus, started, time.time())
            rules = http.get(f"{stack.prometheus}/api/v1/rules").json()["data"]["groups"]
            alerts = http.get(f"{stack.prometheus}/api/v1/alerts").json()["data"]["alerts"]
            png = Path(os.environ.get("LANEWAY_DASHBOARD_PNG") or tmp_path / "overview.png")
            render(stack.prometheus, png, minutes=1.5)
    # The deployment's alerting rules load and evaluate on the real metrics; the
    # always-failing backend's 502s and the missed SLOs make two of them pending.
    evaluated = [r for g in rules for r in g["rules"]]
    assert len(evaluated) >= 12 and {r["health"] for r in evaluated} == {"ok"}
    active = {a["labels"]["alertname"]: a["state"] for a in alerts}
    assert active.get("LanewayErrorRate") in ("pending", "firing")
    assert active.get("LanewaySloAttainmentLow") in ("pending", "firing")
    assert "LanewayModelUnavailable" not in active
    assert [f"{q.panel} [{q.ref}]" for q in empty] == []
    assert [f"{q.panel} [{q.ref}]" for q, v in peak.items() if v is None] == []
    # Rates and quantiles saw something happen, not just series that exist: every
    # panel built on rate() rises above 0 at some point of the run.
    rising: dict[str, bool] = {}
    for q, v in peak.items():
        if "rate(" in q.expr:
            rising[q.panel] = rising.get(q.panel, False) or bool(v)
    assert [panel for panel, seen in rising.items() if not seen] == []
    assert len(rising) >= 10
    assert len(panel_queries()) >= 20
    assert png.stat().st_size > 20_000
