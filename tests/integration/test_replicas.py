"""Two proxy processes on one Redis: one view of sessions, prefixes, load and stored
responses' homes.

Against fake vLLM processes here (fast); `test_replicas_agree_on_real_vllm` and
`test_replicas_share_response_homes_on_real_vllm` repeat the checks in front of real
vLLM-CPU servers.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from bench.harness.proxy_process import ProxyProcess, running_proxy
from bench.harness.services import MissingService, running_fakes, running_redis
from bench.models.backends import Running
from proxy.fleet.vllm_metrics import parse_samples
from tests.proxy.fakes import ADMIN, ADMIN_TOKEN


@pytest.fixture
def redis_url() -> Iterator[str]:
    try:
        with running_redis() as url:
            yield url
    except MissingService as exc:
        pytest.skip(str(exc))


def config(redis_url: str, backends: list[dict[str, str]], policy: str) -> dict[str, Any]:
    return {"backends": backends, "policy": {"name": policy},
            "state": {"backend": "redis", "redis_url": redis_url, "inflight_ttl_s": 1.0},
            "server": {"log_level": "warning"}, "admin": {"token": ADMIN_TOKEN}}


@contextlib.contextmanager
def two_replicas(cfg: dict[str, Any]) -> Iterator[tuple[ProxyProcess, ProxyProcess]]:
    with running_proxy(cfg) as a, running_proxy(cfg) as b:
        yield a, b


HTTP = httpx.Client(timeout=120)  # one client: building one costs ~40 ms (SSL context)


def chat(proxy: ProxyProcess, prompt: str, model: str = "fake", max_tokens: int = 2,
         **headers: str) -> str:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}]}
    response = HTTP.post(f"{proxy.url}/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.headers["x-laneway-backend"]


def backends_of(proxy: ProxyProcess) -> dict[str, dict[str, Any]]:
    listing = HTTP.get(f"{proxy.url}/admin/backends", headers=ADMIN).json()
    return {b["name"]: b for b in listing["backends"]}


def sessions_agree(a: ProxyProcess, b: ProxyProcess, model: str, n: int) -> set[str]:
    homes = {f"user-{i}": chat(a, "hi", model, **{"x-session-id": f"user-{i}"})
             for i in range(n)}
    assert {s: chat(b, "hi", model, **{"x-session-id": s}) for s in homes} == homes
    return set(homes.values())


def prefixes_agree(a: ProxyProcess, b: ProxyProcess, model: str, n: int) -> set[str]:
    # Distinct long documents; a spreads them over the fleet (least in-flight, ties
    # take turns); b never saw them, yet must send follow-ups where a sent them.
    docs = [f"document {i}: " + " ".join(f"w{i}x{j}" for j in range(120)) for i in range(n)]
    homes = {doc: chat(a, doc, model) for doc in docs}
    time.sleep(0.3)  # > a few sync intervals (50 ms)
    assert {doc: chat(b, doc + " and a follow-up question", model) for doc in docs} == homes
    return set(homes.values())


def respond(proxy: ProxyProcess, model: str, previous: str | None = None) -> tuple[str, str]:
    """A Responses API turn through `proxy`: (response id, backend)."""
    body = {"model": model, "input": "Go on", "max_output_tokens": 3,
            "previous_response_id": previous}
    response = HTTP.post(f"{proxy.url}/v1/responses", json=body)
    assert response.status_code == 200, response.text
    return response.json()["id"], response.headers["x-laneway-backend"]


def home_lookups(proxy: ProxyProcess) -> dict[str, float]:
    """`laneway_response_home_lookups_total` by how the home was found."""
    found: dict[str, float] = {}
    for line in HTTP.get(f"{proxy.url}/metrics").text.splitlines():
        if line.startswith("laneway_response_home_lookups_total{"):
            how = line.split('found="', 1)[1].split('"', 1)[0]
            found[how] = float(line.rsplit(" ", 1)[1])
    return found


def conversation_across_replicas(a: ProxyProcess, b: ProxyProcess, model: str,
                                 store: str) -> None:
    """A conversation whose turns alternate between the replicas (as behind a load
    balancer) stays on `store`, the one backend that stores responses, and neither
    replica has to ask the backends where a turn is stored."""
    for _ in range(4):  # round robin reaches the store within the fleet's size
        first, home = respond(a, model)
        if home == store:
            break
    assert home == store
    turns, proxies = [first], [b, a, b]
    for proxy in proxies:
        time.sleep(0.3)  # > a few sync intervals (50 ms)
        turn, home = respond(proxy, model, previous=turns[-1])
        assert home == store
        turns.append(turn)
    time.sleep(0.3)
    fetched = HTTP.get(f"{a.url}/v1/responses/{turns[-1]}")  # made through b
    assert fetched.status_code == 200 and fetched.json()["id"] == turns[-1]
    assert fetched.headers["x-laneway-backend"] == store
    assert home_lookups(a) == {"remembered": 2.0}  # turn 3, the GET
    assert home_lookups(b) == {"remembered": 2.0}  # turns 2 and 4


def test_replicas_share_response_homes(redis_url: str) -> None:
    # Every fake stores responses, and only the one that made it has it.
    with running_fakes(3) as urls:
        fleet = [{"name": f"f{i}", "url": u, "model": "fake"} for i, u in enumerate(urls)]
        with two_replicas(config(redis_url, fleet, "round_robin")) as (a, b):
            conversation_across_replicas(a, b, "fake", "f1")
        memory = config(redis_url, fleet, "round_robin") | {"state": {}}
        with two_replicas(memory) as (a, b):  # unshared: b asks the backends
            first, home = respond(a, "fake")
            assert respond(b, "fake", previous=first)[1] == home
            assert home_lookups(b) == {"asked": 1.0}


def test_sessions_and_prefixes_agree_across_replicas(redis_url: str) -> None:
    with running_fakes(3) as urls:
        fleet = [{"name": f"f{i}", "url": u, "model": "fake"} for i, u in enumerate(urls)]
        with two_replicas(config(redis_url, fleet, "session")) as (a, b):
            assert len(sessions_agree(a, b, "fake", 30)) == 3
        with two_replicas(config(redis_url, fleet, "prefix_aware")) as (a, b):
            assert len(prefixes_agree(a, b, "fake", 6)) == 3


def test_inflight_counts_add_up_and_a_crashed_replicas_vanish(redis_url: str) -> None:
    # Streams of 200 tokens at 20 ms: ~4 s open.
    with running_fakes(2, "--tpot-ms", "20") as urls:
        fleet = [{"name": f"f{i}", "url": u, "model": "fake"} for i, u in enumerate(urls)]
        cfg = config(redis_url, fleet, "least_request")
        with running_proxy(cfg) as a, running_proxy(cfg) as b, \
                ThreadPoolExecutor(8) as pool:
            on_a = [pool.submit(chat, a, "x", "fake", 200) for _ in range(3)]
            time.sleep(0.5)  # a holds 3 streams: 2 on one backend, 1 on the other
            a_local = {n: s["inflight"] for n, s in backends_of(a).items()}
            lighter = min(a_local, key=a_local.__getitem__)
            on_b = pool.submit(chat, b, "x", "fake", 200)
            time.sleep(0.5)
            seen_by_a, seen_by_b = backends_of(a), backends_of(b)
            assert sorted(a_local.values()) == [1, 2]
            # b sent its stream to the backend a loaded less: it sees a's streams.
            assert {n: s["inflight"] for n, s in seen_by_b.items()} == {
                n: int(n == lighter) for n in a_local}
            for seen in (seen_by_a, seen_by_b):
                assert {n: s["cluster_inflight"] for n, s in seen.items()} == {
                    n: 2 for n in a_local}
            os.kill(a.pid, signal.SIGKILL)  # a crashes with its 3 streams open
            time.sleep(1.6)  # > state.inflight_ttl_s
            after = backends_of(b)
            assert {n: s["cluster_inflight"] for n, s in after.items()} == {
                n: int(n == lighter) for n in a_local}
            assert on_b.result() == lighter
            for future in on_a:
                with pytest.raises(httpx.TransportError):
                    future.result()


def test_replicas_whose_flow_control_differs_show_it(redis_url: str) -> None:
    """A replica started without strict flow control beside a strict one: both count
    two flow-control modes (the alert LanewayFlowControlMismatch reads it)."""
    def modes(proxy: ProxyProcess) -> float:
        page = HTTP.get(f"{proxy.url}/metrics").text
        return float(re.search(r"^laneway_state_flow_modes (\S+)$", page, re.M)[1])  # type: ignore[index]

    with running_fakes(1) as urls:
        fleet = [{"name": "f0", "url": urls[0], "model": "fake"}]
        strict = config(redis_url, fleet, "round_robin") | {
            "flow_control": {"max_inflight_per_backend": 4}}
        loose = strict | {"flow_control": {"max_inflight_per_backend": 4, "strict": False}}
        with running_proxy(strict) as a:
            time.sleep(0.3)  # a few syncs (50 ms) alone
            assert modes(a) == 1
            with running_proxy(loose) as b:
                time.sleep(0.3)
                assert modes(a) == modes(b) == 2
            time.sleep(1.3)  # > state.inflight_ttl_s after b left
            assert modes(a) == 1


def test_an_adapter_loaded_through_one_replica_is_routable_through_the_other(
        redis_url: str) -> None:
    """`/admin/lora_adapters` on replica a: b reads the changed backends' lists within
    a sync interval, though its periodic read is an hour away."""
    with running_fakes(2, "--lora-runtime") as urls:
        fleet = [{"name": f"f{i}", "url": u, "model": "fake"} for i, u in enumerate(urls)]
        cfg = config(redis_url, fleet, "round_robin") | {"poller": {"models_interval_s": 3600}}
        body = {"model": "sql", "max_tokens": 2, "messages": [{"role": "user", "content": "q"}]}
        with two_replicas(cfg) as (a, b):
            before = HTTP.post(f"{b.url}/v1/chat/completions", json=body)
            loaded = HTTP.post(f"{a.url}/admin/lora_adapters", headers=ADMIN, json={
                "lora_name": "sql", "lora_path": "/adapters/sql", "backends": ["f1"]})
            time.sleep(0.5)  # > a few sync intervals (50 ms) and a read
            on_b = [HTTP.post(f"{b.url}/v1/chat/completions", json=body) for _ in range(3)]
            unloaded = HTTP.delete(f"{a.url}/admin/lora_adapters/sql", headers=ADMIN)
            time.sleep(0.5)
            gone = HTTP.post(f"{b.url}/v1/chat/completions", json=body)
    assert before.status_code == 404
    assert loaded.status_code == 200 and unloaded.status_code == 200
    assert [r.headers.get("x-laneway-backend") for r in on_b] == ["f1"] * 3
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


@pytest.mark.vllm
def test_replicas_agree_on_real_vllm(redis_url: str, vllm_fleet: list[Running]) -> None:
    small = [s for s in vllm_fleet if s.model == "tiny-llama"][:2]
    fleet = [{"name": s.name, "url": f"http://127.0.0.1:{s.port}", "model": s.model}
             for s in small]
    with two_replicas(config(redis_url, fleet, "session")) as (a, b):
        assert len(sessions_agree(a, b, "tiny-llama", 6)) == 2
    with two_replicas(config(redis_url, fleet, "prefix_aware")) as (a, b):
        assert len(prefixes_agree(a, b, "tiny-llama", 4)) == 2


@pytest.mark.vllm
def test_replicas_share_response_homes_on_real_vllm(redis_url: str, vllm_fleet: list[Running],
                                                    store_server: Running) -> None:
    small = next(s for s in vllm_fleet if s.model == "tiny-llama")
    fleet = [{"name": small.name, "url": f"http://127.0.0.1:{small.port}",
              "model": "tiny-llama"},
             {"name": "store", "url": store_server.url, "model": "tiny-llama"}]
    with two_replicas(config(redis_url, fleet, "round_robin")) as (a, b):
        conversation_across_replicas(a, b, "tiny-llama", "store")


@pytest.mark.vllm
def test_strict_flow_control_holds_across_replicas_on_real_vllm(
        redis_url: str, vllm_fleet: list[Running]) -> None:
    """Two replicas, room for one request on the one vLLM: it never holds two (strict
    flow control's slot leases; without them both replicas fill the room at once)."""
    large = next(s for s in vllm_fleet if s.model == "tiny-llama-large")
    fleet = [{"name": large.name, "url": large.url, "model": large.model}]
    cfg = config(redis_url, fleet, "round_robin") | {
        "flow_control": {"max_inflight_per_backend": 1}}  # strict: the default
    peak = 0.0
    with two_replicas(cfg) as (a, b), ThreadPoolExecutor(6) as pool:
        asked = [pool.submit(chat, replica, f"story {i}", large.model, 12)
                 for i in range(3) for replica in (a, b)]
        while not all(f.done() for f in asked):
            samples = parse_samples(HTTP.get(f"{large.url}/metrics").text)
            peak = max(peak, samples.get("vllm:num_requests_running", 0.0)
                       + samples.get("vllm:num_requests_waiting", 0.0))
            time.sleep(0.01)
        served = [f.result() for f in asked]
    assert served == [large.name] * 6
    assert peak == 1
