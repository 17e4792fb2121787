"""SLO classes (docs/slice.md, SLO classes in the proxy): chosen by key or header,
forwarded only to opted-in backends, never promotable by the client, carried by a
migrated continuation with what is left of the deadline, and counted per class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.fakes.fake_vllm import FakeConfig
from proxy.admission.auth import hash_key
from proxy.admission.slo_classes import upstream_body
from proxy.config import ConfigError, load_settings
from proxy.http.server import RunningProxy
from proxy.observability.metrics import slo_met
from proxy.types import Backend, Outcome, SloTarget
from tests.proxy.fakes import CHAT, fleet, post

CLASSES: dict[str, Any] = {
    "realtime": {"tpot_ms": 50, "deadline_ms": 1500, "utility": 50, "priority": -1},
    "text": {"tpot_ms": 100, "ttft_ms": 2000, "utility": 1, "priority": 5},
}
SLO: dict[str, Any] = {"slo_classes": CLASSES, "default_slo_class": "text"}
SLICE, PRIORITY = {"scheduler": "slice"}, {"scheduler": "priority"}
REALTIME = SloTarget("realtime", 50.0, 50.0, -1, deadline_ms=1500.0)


def xargs(name: str, tpot: float, utility: float) -> dict[str, Any]:
    return {"laneway_slo_class": name, "laneway_tpot_ms": tpot, "laneway_utility": utility}


def metrics_of(proxy: RunningProxy) -> str:
    rt = proxy.app.runtime
    assert rt is not None
    return rt.metrics.render().decode()


# --- choosing the class -------------------------------------------------------------

async def test_class_by_header_with_auth_off_and_default_without_one() -> None:
    async with fleet(FakeConfig(), labels=(SLICE,), **SLO) as (proxy, fakes):
        named = await post(proxy, CHAT, headers={"x-laneway-slo-class": "realtime"})
        unnamed = await post(proxy, CHAT)
    assert named.status_code == unnamed.status_code == 200
    first, second = fakes[0].app.stats.bodies
    assert first["vllm_xargs"].pop("laneway_deadline_ms") <= 1500
    assert first["vllm_xargs"] == xargs("realtime", 50, 50) and first["priority"] == -1
    assert second["vllm_xargs"] == xargs("text", 100, 1) and second["priority"] == 5


async def test_unknown_class_header_is_an_openai_400_and_never_a_label() -> None:
    async with fleet(FakeConfig(), labels=(SLICE,), **SLO) as (proxy, fakes):
        response = await post(proxy, CHAT, headers={"x-laneway-slo-class": "vip"})
        metrics = metrics_of(proxy)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "'vip'" in error["message"]
    assert fakes[0].app.stats.requests == 0
    assert "vip" not in metrics


async def test_class_by_key_and_the_header_cannot_change_it() -> None:
    auth = {"enabled": True, "keys": [
        {"name": "robot", "sha256": hash_key("sk-robot"), "slo_class": "realtime"},
        {"name": "reader", "sha256": hash_key("sk-reader")}]}
    async with fleet(FakeConfig(), labels=(SLICE,), auth=auth, **SLO) as (proxy, fakes):
        robot = await post(proxy, CHAT, headers={"authorization": "Bearer sk-robot"})
        reader = await post(proxy, CHAT, headers={"authorization": "Bearer sk-reader",
                                                  "x-laneway-slo-class": "realtime"})
        unknown = await post(proxy, CHAT, headers={"authorization": "Bearer sk-reader",
                                                   "x-laneway-slo-class": "vip"})
    assert robot.status_code == reader.status_code == unknown.status_code == 200
    classes = [b["vllm_xargs"]["laneway_slo_class"] for b in fakes[0].app.stats.bodies]
    assert classes == ["realtime", "text", "text"]  # the key's class (reader: default)


# --- forwarding ---------------------------------------------------------------------

async def test_only_opted_in_backends_get_the_class() -> None:
    configs = (FakeConfig(), FakeConfig(), FakeConfig())
    async with fleet(*configs, labels=(SLICE, PRIORITY, {"gpu": "a100"}), **SLO) as (
            proxy, fakes):
        for _ in range(3):  # round robin: one each
            assert (await post(proxy, CHAT)).status_code == 200
    (slice_body,), (priority_body,), (plain_body,) = (f.app.stats.bodies for f in fakes)
    assert slice_body == {**CHAT, "vllm_xargs": xargs("text", 100, 1), "priority": 5}
    assert priority_body == {**CHAT, "priority": 5}
    assert plain_body == CHAT


async def test_without_classes_no_class_is_added() -> None:
    """Only what every request loses (the client's priority and laneway_* keys:
    tests/security) is gone; nothing of a class comes in its place."""
    body = {**CHAT, "priority": -3, "vllm_xargs": {"laneway_utility": 9, "keep": 1}}
    async with fleet(FakeConfig(), labels=(SLICE,)) as (proxy, fakes):
        assert (await post(proxy, body)).status_code == 200
    assert fakes[0].app.stats.bodies == [{**CHAT, "vllm_xargs": {"keep": 1}}]


async def test_a_client_cannot_promote_itself() -> None:
    sent_headers: list[dict[str, str]] = []
    body = {**CHAT, "priority": -100, "vllm_xargs": {
        "laneway_slo_class": "realtime", "laneway_utility": 1e9, "laneway_tpot_ms": 1,
        "laneway_deadline_ms": 10, "session_id": "s1"}}
    async with fleet(FakeConfig(), FakeConfig(), labels=(SLICE, {}), **SLO) as (
            proxy, fakes):
        rt = proxy.app.runtime
        assert rt is not None
        opened = rt.upstream.open

        async def spy(backend: Backend, path: str, data: bytes | None,
                      headers: dict[str, str], stream: bool, method: str = "POST") -> Any:
            sent_headers.append(headers)
            return await opened(backend, path, data, headers, stream, method)

        rt.upstream.open = spy  # type: ignore[method-assign, assignment]
        for _ in range(2):
            response = await post(proxy, body, headers={"X-Vllm-Priority": "-50"})
            assert response.status_code == 200
    assert fakes[0].app.stats.bodies == [{**CHAT, "priority": 5, "vllm_xargs": {
        "session_id": "s1", **xargs("text", 100, 1)}}]
    assert fakes[1].app.stats.bodies == [{**CHAT, "vllm_xargs": {"session_id": "s1"}}]
    assert len(sent_headers) == 2
    assert all("x-vllm-priority" not in {k.lower() for k in h} for h in sent_headers)


def test_upstream_body_in_isolation() -> None:
    """(The client's own priority and laneway_* keys are stripped at parse, before this:
    test_a_client_cannot_promote_itself.)"""
    backend = Backend("b", "http://b", "m", labels={"scheduler": "slice"})
    data = {"model": "m", "vllm_xargs": {"keep": "y"}}
    body = upstream_body(data, REALTIME, backend, "chat", elapsed_s=0.5)
    assert body == {"model": "m", "priority": -1, "vllm_xargs": {
        "keep": "y", **xargs("realtime", 50.0, 50.0), "laneway_deadline_ms": 1000.0}}
    late = upstream_body(data, REALTIME, backend, "messages", elapsed_s=2.0)
    assert "laneway_deadline_ms" not in late["vllm_xargs"]  # passed: the class's TPOT
    assert "priority" not in late  # Anthropic's schema has none


# --- migration ----------------------------------------------------------------------

async def test_a_continuation_carries_the_class_and_what_is_left_of_the_deadline() -> None:
    slow = FakeConfig(tpot_s=0.03)
    settings: dict[str, Any] = {**SLO, "debug": {"allow_forced_migration": True}}
    async with fleet(slow, slow, labels=(SLICE, SLICE), **settings) as (proxy, fakes):
        response = await post(
            proxy, {"model": "fake", "prompt": "one two", "stream": True, "max_tokens": 12,
                    "priority": -100},
            "/v1/completions", headers={"x-laneway-migrate-after": "4",
                                        "x-laneway-slo-class": "realtime"})
    assert response.status_code == 200
    bodies = [b for f in fakes for b in f.app.stats.bodies]
    first = next(b for b in bodies if isinstance(b["prompt"], str))
    continued = [b for b in bodies if isinstance(b["prompt"], list)]  # warm-up and/or cont.
    assert continued and all(b["priority"] == -1 for b in [first, *continued])
    first_left = first["vllm_xargs"]["laneway_deadline_ms"]
    assert 0 < first_left <= 1500
    for body in continued:
        left = body["vllm_xargs"].pop("laneway_deadline_ms")
        assert 0 < left < first_left  # four tokens (>= 90 ms) later: less is left
        assert body["vllm_xargs"] == xargs("realtime", 50, 50)


# --- metrics ------------------------------------------------------------------------

async def test_metrics_per_class_met_and_missed() -> None:
    classes: dict[str, Any] = {"loose": {"tpot_ms": 1000, "ttft_ms": 10_000},
               "tight": {"tpot_ms": 1000, "ttft_ms": 1}}  # the fake's 50 ms TTFT misses
    async with fleet(FakeConfig(ttft_s=0.05), slo_classes=classes,
                     default_slo_class="loose") as (proxy, _):
        stream = {**CHAT, "stream": True, "max_tokens": 4}
        for name in ("loose", "loose", "tight"):
            response = await post(proxy, stream, headers={"x-laneway-slo-class": name})
            assert response.status_code == 200
        metrics = metrics_of(proxy)
    assert 'laneway_slo_class_requests_total{outcome="met",slo_class="loose"} 2.0' in metrics
    assert 'laneway_slo_class_requests_total{outcome="missed",slo_class="tight"} 1.0' \
        in metrics
    assert 'outcome="missed",slo_class="loose"' not in metrics
    assert 'laneway_slo_class_ttft_seconds_count{slo_class="loose"} 2.0' in metrics
    assert 'laneway_slo_class_tpot_seconds_count{slo_class="tight"} 1.0' in metrics


def outcome(**changes: Any) -> Outcome:
    fields: dict[str, Any] = {
        "request_id": "r", "model": "m", "backend": "b", "policy": "p", "status": 200,
        "ok": True, "started_at": 0.0, "ttft_s": 0.1, "e2e_s": 1.0,
        "completion_tokens": 10, "tpot_s": 0.09}
    return Outcome(**(fields | changes))


def test_slo_met_judges_as_the_paper() -> None:
    text = SloTarget("text", 100.0, 1.0, ttft_ms=200.0)
    assert slo_met(text, outcome())
    assert not slo_met(text, outcome(ttft_s=0.3))  # TTFT over
    assert not slo_met(text, outcome(tpot_s=0.11))  # mean TPOT over
    assert not slo_met(text, outcome(ok=False, status=502))
    # not streamed: the whole answer within TTFT + 9 more tokens' TPOT (1.1 s)
    assert slo_met(text, outcome(tpot_s=None, ttft_s=1.0, e2e_s=1.0))
    assert not slo_met(text, outcome(tpot_s=None, ttft_s=1.2, e2e_s=1.2))
    # real-time: completion within the deadline, whatever the TPOT
    assert slo_met(REALTIME, outcome(e2e_s=1.4, tpot_s=0.2))
    assert not slo_met(REALTIME, outcome(e2e_s=1.6, tpot_s=0.01))


# --- configuration ------------------------------------------------------------------

GOOD = """
backends:
  - {name: a, url: "http://10.0.0.1:8000", model: m, labels: {scheduler: slice}}
  - {name: b, url: "http://10.0.0.2:8000", model: m, labels: {scheduler: priority}}
slo_classes:
  realtime: {tpot_ms: 50, deadline_ms: 1500, utility: 50, priority: -1}
  text: {tpot_ms: 100, ttft_ms: 2000}
default_slo_class: text
auth:
  keys: [{name: robot, sha256: "%s", slo_class: realtime}]
""" % ("0" * 64)


def test_config_loads_classes(tmp_path: Path) -> None:
    path = tmp_path / "laneway.yaml"
    path.write_text(GOOD)
    settings = load_settings(path)
    assert settings.slo_classes["realtime"].deadline_ms == 1500
    assert settings.slo_classes["text"].utility == 1.0 and settings.default_slo_class == "text"
    assert settings.auth.keys[0].slo_class == "realtime"


@pytest.mark.parametrize(("change", "message"), [
    (("default_slo_class: text", "default_slo_class: gold"),
     "default_slo_class: no SLO class 'gold'"),
    (("default_slo_class: text", ""), "default_slo_class is required"),
    (("slo_class: realtime", "slo_class: rt"), "auth.keys[robot].slo_class: no SLO class"),
    (("{tpot_ms: 100, ttft_ms: 2000}", "{tpot_ms: 100}"), "either ttft_ms or deadline_ms"),
    (("{tpot_ms: 100, ttft_ms: 2000}", "{tpot_ms: 100, ttft_ms: 1, deadline_ms: 9}"),
     "either ttft_ms or deadline_ms"),
    (("{tpot_ms: 100, ttft_ms: 2000}", "{tpot_ms: 0, ttft_ms: 2000}"), "slo_classes.text"),
    (("scheduler: priority", "scheduler: fifo"), "label scheduler: 'fifo'"),
    (("  text: {", '  "te xt": {'), "must match"),
])
def test_config_errors_name_the_key(tmp_path: Path, change: tuple[str, str],
                                    message: str) -> None:
    text = GOOD.replace(*change)
    if change[0] == "  text: {":
        text = text.replace("default_slo_class: text", '"default_slo_class": "te xt"')
    path = tmp_path / "laneway.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert message in str(err.value)


def test_stream_body_round_trips_through_orjson() -> None:
    """The forwarded values are flat str/float (vLLM's vllm_xargs type)."""
    backend = Backend("b", "http://b", "m", labels={"scheduler": "slice"})
    body = upstream_body({"model": "m"}, REALTIME, backend, "completions", 0.0)
    assert all(isinstance(v, (str, int, float)) for v in body["vllm_xargs"].values())
    assert orjson.loads(orjson.dumps(body)) == body
