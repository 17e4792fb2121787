"""Fuzzing through the proxy against real vLLM: the proxy answers what vLLM answers.

Each case (tests/proxy/fuzzing.py: a valid body of a generation route or /tokenize with
fields set to values of any JSON type, deleted, or changed deep inside) goes to a vLLM
server directly and through the proxy in front of the two servers of the same model,
with migration on and, in half the cases, a move forced after the first tokens. The
proxy must accept what vLLM accepts (the same 2xx), refuse what it refuses (a 4xx, from
vLLM or from the proxy's own checks of the same fields), never answer a success for a
request vLLM fails, never fail itself (nothing logged at ERROR, no traceback), and keep
the API's shapes. The bodies are bounded to a few tokens so that a case costs ~0.1 s.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.harness.proxy_process import running_proxy
from tests.proxy.fuzzing import body_of, check_shape, dumps, fuzz

pytestmark = pytest.mark.vllm

SMALL = "tiny-llama"
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
          "/tokenize")
LENGTH_KEY = {"/v1/responses": "max_output_tokens", "/tokenize": None}
# In half the cases a move forced after a few tokens (debug.allow_forced_migration): the
# stream continues on the other server from the token ids so far.
MOVES = st.sampled_from([{}, {"x-laneway-migrate-after": "2"}])


def bounded(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """`body` with a small length bound if it has none (a case would otherwise run to
    the context's end, ~4 s on these servers)."""
    key = LENGTH_KEY.get(path, "max_tokens")
    if key is not None and "max_tokens" not in body and "max_completion_tokens" not in body:
        body = {key: 8, **body}
    return body


CASES = st.sampled_from(ROUTES).flatmap(lambda path: st.tuples(
    st.just(path), body_of(path, SMALL).map(lambda b: dumps(bounded(path, b))), MOVES))


class Proxy:
    def __init__(self, url: str, log: Path, direct: str) -> None:
        self.url, self.log, self.direct = url, log, direct

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def serving(fleet: Any, tmp: pytest.TempPathFactory, **migration: Any) -> Iterator[Proxy]:
    small = [b for b in fleet if b.model == SMALL]
    log = tmp.mktemp("fuzz") / "proxy.log"
    config = {
        "backends": [{"name": b.name, "url": b.url, "model": b.model} for b in small],
        "policy": {"name": "prefix_aware"},
        "server": {"access_log": True, "max_tokens_limit": 1024},
        "migration": {"enabled": True, "non_stream": True, **migration},
        "debug": {"allow_forced_migration": True},
    }
    with running_proxy(config, log_path=log) as running:
        yield Proxy(running.url, log, small[0].url)


@pytest.fixture(scope="module")
def proxy(vllm_fleet: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    yield from serving(vllm_fleet, tmp_path_factory)


@pytest.fixture(scope="module")
def cold_proxy(vllm_fleet: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    """Forced moves splice where asked (the source frozen there, no race with a warmed
    target), so that a short greedy answer is moved, not finished first
    (tests/integration/test_migration_vllm.py does the same)."""
    yield from serving(vllm_fleet, tmp_path_factory, warm_prefill=False, pace_slowdown=0)


def same_status(path: str, body: bytes, direct: httpx.Response, through: httpx.Response
                ) -> str:
    """Check that the proxy answered as vLLM did: the same success, a 4xx for a 4xx, no
    success for a failure, never its own internal error; returns the case, told."""
    said = f"{path} {body[:400]!r}: vLLM {direct.status_code} {direct.text[:300]}, " \
           f"laneway {through.status_code} {through.text[:300]}"
    if direct.is_success:
        assert through.status_code == direct.status_code, said
    elif direct.status_code < 500:
        assert 400 <= through.status_code < 500, said
    else:  # vLLM failed on it: so may the answer through the proxy, not succeed
        assert not through.is_success, said
    assert "laneway failed on this request" not in through.text, said
    return said


def streams(answer: httpx.Response) -> bool:
    return bool(answer.headers.get("content-type", "").startswith("text/event-stream"))


@fuzz(150)
@given(CASES)
def test_the_proxy_answers_what_vllm_answers(proxy: Proxy,
                                            case: tuple[str, bytes, dict[str, str]]) -> None:
    path, body, headers = case
    json = {"content-type": "application/json"}
    with httpx.Client(timeout=60) as http:
        direct = http.post(proxy.direct + path, content=body, headers=json)
        through = http.post(proxy.url + path, content=body, headers={**json, **headers})
    said = same_status(path, body, direct, through)
    if direct.is_success:
        assert streams(through) == streams(direct), said
        if not streams(direct):  # the same kind of answer, with as many choices
            mine, theirs = through.json(), direct.json()
            assert mine.get("object") == theirs.get("object"), said
            assert len(mine.get("choices", ())) == len(theirs.get("choices", ())), said
    check_shape(path, through)
    text = proxy.log_text()
    assert "Traceback" not in text and " ERROR " not in text, text[-3000:]


@st.composite
def greedy_case(draw: st.DrawFn) -> tuple[str, bytes]:
    """A chat or completions case made greedy (temperature 0): another server of the same
    weights regenerates the same tokens, so a move must not change a byte of the text."""
    path = draw(st.sampled_from(("/v1/chat/completions", "/v1/completions")))
    body = bounded(path, draw(body_of(path, SMALL)))
    return path, dumps({**body, "temperature": 0})


def texts(answer: httpx.Response) -> dict[int, str]:
    """Each choice's generated text, from a whole answer or from its stream's deltas."""
    if not streams(answer):
        return {c["index"]: (c.get("message") or {}).get("content") or c.get("text") or ""
                for c in answer.json()["choices"]}
    found: dict[int, str] = {}
    for line in answer.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in orjson.loads(line[6:]).get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            found[choice["index"]] = found.get(choice["index"], "") + piece
    return found


@fuzz(40)
@given(greedy_case())
def test_a_greedy_answer_moved_after_two_tokens_is_the_answer_left_alone(
        cold_proxy: Proxy, case: tuple[str, bytes]) -> None:
    """Whatever else the request asks (stop strings, penalties, logit bias, min_tokens,
    usage, token ids, ...), a move forced after two tokens leaves the text as vLLM
    writes it unmoved (or the request is not moved: logprobs, n > 1, ...)."""
    path, body = case
    json = {"content-type": "application/json"}
    with httpx.Client(timeout=60) as http:
        direct = http.post(cold_proxy.direct + path, content=body, headers=json)
        moved = http.post(cold_proxy.url + path, content=body,
                          headers={**json, "x-laneway-migrate-after": "2"})
    said = same_status(path, body, direct, moved)
    if direct.is_success:
        assert texts(moved) == texts(direct), said
