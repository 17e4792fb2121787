"""Token-ID migration against in-process fakes whose token ids continue across backends.

The fake's generated token i reads `tok<i> ` with id 100+i, and a token-id prompt
ending in generated ids resumes the count, like greedy decoding of one model on two
servers. So a spliced answer must read tok0 … tok<n-1>, once each, in order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import re
from types import MappingProxyType
from typing import Any

import httpx
import orjson
import pytest

from bench.fakes.fake_vllm import REFUSAL, FakeConfig
from bench.fakes.fake_wire import GEN_BASE
from policies.base import POLICIES, NoParams, register
from proxy.types import ClusterView, Decision, Outcome, Prediction, Progress, RequestContext
from tests.proxy.fakes import ADMIN, CHAT, events, fleet, post

FORCED = {"debug": {"allow_forced_migration": True}}
COMPLETION = {"model": "fake", "prompt": "one two three"}


def expected_text(n: int) -> str:
    return "".join(f"tok{i} " for i in range(n))


def stream_text(response: httpx.Response, chat: bool = True) -> str:
    parts = []
    for data in events(response.text):
        if data == "[DONE]":
            continue
        for choice in orjson.loads(data)["choices"]:
            parts.append((choice.get("delta") or {}).get("content") or "" if chat
                         else choice["text"])
    return "".join(parts)


def migrated_comments(response: httpx.Response) -> list[dict[str, Any]]:
    prefix = ": laneway "
    return [orjson.loads(line[len(prefix):]) for line in response.text.split("\n")
            if line.startswith(prefix)]


def continuation_bodies(fake: Any, warm: bool = False) -> list[dict[str, Any]]:
    """Token-id requests a fake received: continuations (streamed) or warm-ups."""
    return [b for b in fake.app.stats.bodies
            if isinstance(b.get("prompt"), list) and b.get("stream") is not warm]


@pytest.mark.parametrize(("after", "greedy"), [
    (0, True), (1, True), (7, True),  # paced: one token before the end races the source's
    (0, False), (1, False), (7, False), (11, False)],  # last token, so only when frozen
    ids=["paced-0", "paced-1", "paced-7", "frozen-0", "frozen-1", "frozen-7", "frozen-11"])
async def test_forced_move_of_a_chat_stream_loses_and_repeats_nothing(
    after: int, greedy: bool
) -> None:
    slow = FakeConfig(tpot_s=0.05)  # a warm-up ends before the source's next token
    async with fleet(slow, slow, **FORCED) as (proxy, fakes):
        body = {**CHAT, "stream": True, "max_tokens": 12,
                "stream_options": {"include_usage": True}}
        if greedy:
            body["temperature"] = 0
        response = await post(proxy, body, headers={"x-laneway-migrate-after": str(after),
                                                    "x-laneway-events": "1"})
    assert response.status_code == 200
    assert stream_text(response) == expected_text(12)
    data = [orjson.loads(e) for e in events(response.text)[:-1]]
    assert {d["id"] for d in data} == {data[0]["id"]}  # one response, however spliced
    assert all(d["object"] == "chat.completion.chunk" for d in data)
    assert data[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert data[-1]["usage"]["completion_tokens"] == 12
    assert data[-1]["usage"]["prompt_tokens"] == 2  # BOS + one word: the original prompt
    assert data[-2]["choices"][0]["finish_reason"] == "length"
    assert all(d["choices"][0].get("token_ids") is None for d in data[1:-1])
    (moved,) = migrated_comments(response)
    assert moved["reason"] == "forced" and moved["at_token"] >= after
    target = fakes[1] if moved["to"] == "f1" else fakes[0]
    (cont,) = continuation_bodies(target)
    if greedy:  # paced: the target continues from the trigger point, no warm-up
        assert continuation_bodies(target, warm=True) == []
        spliced_at = after
        assert moved["continued_from"] == after
    else:  # frozen: warm-up first, then a continuation from where the client is
        (warm,) = continuation_bodies(target, warm=True)
        assert warm["max_tokens"] == 1 and 2 + after <= len(warm["prompt"])
        assert len(warm["prompt"]) <= 2 + moved["at_token"]
        spliced_at = moved["at_token"]
    assert len(cont["prompt"]) == 2 + spliced_at
    assert cont["max_tokens"] == 12 - spliced_at
    assert cont.get("temperature") == (0 if greedy else None) and cont["stream"] is True
    assert spliced_at == 0 or cont["prompt"][-1] == GEN_BASE + spliced_at - 1


async def test_forced_move_of_completions_and_non_streamed_requests() -> None:
    async with fleet(FakeConfig(), FakeConfig(), **FORCED) as (proxy, _):
        headers = {"x-laneway-migrate-after": "3"}
        stream = await post(proxy, {**COMPLETION, "stream": True, "max_tokens": 8},
                            "/v1/completions", headers=headers)
        whole = await post(proxy, {**COMPLETION, "max_tokens": 8, "return_token_ids": True},
                           "/v1/completions", headers=headers)
        chat = await post(proxy, {**CHAT, "max_tokens": 8}, headers=headers)
    assert stream_text(stream, chat=False) == expected_text(8)
    choice = whole.json()["choices"][0]
    assert choice["text"] == expected_text(8)
    assert choice["token_ids"] == list(range(GEN_BASE, GEN_BASE + 8))
    assert whole.json()["usage"]["completion_tokens"] == 8
    assert chat.json()["choices"][0]["message"]["content"] == expected_text(8)
    assert chat.json()["object"] == "chat.completion"


async def test_forced_header_is_ignored_unless_allowed() -> None:
    async with fleet(FakeConfig(), FakeConfig()) as (proxy, fakes):
        response = await post(proxy, {**CHAT, "stream": True, "max_tokens": 6},
                              headers={"x-laneway-migrate-after": "2"})
    assert stream_text(response) == expected_text(6)
    assert sum(len(continuation_bodies(f)) for f in fakes) == 0


async def test_backend_dying_mid_stream_is_continued_elsewhere() -> None:
    dying, healthy = FakeConfig(die_after_tokens=4), FakeConfig()
    async with fleet(dying, healthy, policy={"name": "round_robin"}) as (proxy, fakes):
        response = await post(proxy, {**CHAT, "stream": True, "max_tokens": 10},
                              headers={"x-laneway-events": "1"})
        metrics = (await httpx.AsyncClient().get(f"{proxy.url}/metrics")).text
    assert response.headers["x-laneway-backend"] == "f0"
    assert stream_text(response) == expected_text(10)
    assert migrated_comments(response)[0] == {
        "event": "migrated", "from": "f0", "to": "f1", "at_token": 4, "reason": "failure",
        "continued_from": 4}
    assert continuation_bodies(fakes[1])[0]["max_tokens"] == 6
    assert 'laneway_migrations_total{reason="failure",source="f0",target="f1"} 1.0' in metrics


async def test_a_malformed_event_mid_stream_is_a_failure_continued_elsewhere() -> None:
    """A backend whose event the relay cannot use fails like one that died (before, the
    proxy itself broke: a 500 or a cut stream)."""
    async with fleet(FakeConfig(garble_after_tokens=4), FakeConfig()) as (proxy, _):
        response = await post(proxy, {**CHAT, "stream": True, "max_tokens": 10},
                              headers={"x-laneway-events": "1"})
    assert stream_text(response) == expected_text(10)
    (moved,) = migrated_comments(response)
    assert (moved["from"], moved["to"], moved["at_token"], moved["reason"]) == (
        "f0", "f1", 4, "failure")  # the tokens before it are shown, whatever the chunks


async def test_failure_without_another_backend_ends_with_error_event() -> None:
    async with fleet(FakeConfig(die_after_tokens=3)) as (proxy, _):
        response = await post(proxy, {**CHAT, "stream": True, "max_tokens": 10})
    data = events(response.text)
    assert stream_text_until_error(data) == expected_text(3)
    assert orjson.loads(data[-2])["error"]["type"] == "upstream_error"


def stream_text_until_error(data: list[str]) -> str:
    return "".join((orjson.loads(d)["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                   for d in data if d != "[DONE]" and "error" not in orjson.loads(d))


async def test_draining_a_backend_moves_its_streams() -> None:
    slow = FakeConfig(tpot_s=0.01)
    async with fleet(slow, slow, policy={"name": "round_robin"}) as (proxy, fakes):
        request = asyncio.create_task(post(proxy, {**CHAT, "stream": True, "max_tokens": 60}))
        await asyncio.sleep(0.15)
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            drained = await http.post("/admin/backends/f0/drain", headers=ADMIN)
            response = await request
            after = await post(proxy, {**CHAT, "max_tokens": 2})
    assert drained.json()["moving"] == 1
    assert stream_text(response) == expected_text(60)
    assert len(continuation_bodies(fakes[1])) == 1
    assert after.headers["x-laneway-backend"] == "f1"


async def test_admin_api_checks_its_token_and_names() -> None:
    async with fleet(FakeConfig(), admin={"token": "s3cret"}) as (proxy, _):
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            anonymous = await http.post("/admin/backends/f0/drain")
            unknown = await http.post("/admin/backends/nope/drain",
                                      headers={"authorization": "Bearer s3cret"})
            bad = await http.post("/admin/backends/f0/drain", content=b"{",
                                  headers={"authorization": "Bearer s3cret",
                                           "content-type": "application/json"})
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
    assert unknown.status_code == 404
    assert bad.status_code == 400


async def test_moves_per_request_are_limited() -> None:
    async with fleet(FakeConfig(die_after_tokens=2), FakeConfig(die_after_tokens=2),
                     FakeConfig(die_after_tokens=2), migration={"max_per_request": 1}) as (
            proxy, _):
        response = await post(proxy, {**CHAT, "stream": True, "max_tokens": 10})
    data = events(response.text)
    assert stream_text_until_error(data) == expected_text(4)
    assert "error" in orjson.loads(data[-2])


async def test_disconnect_during_handoff_cancels_both_backends() -> None:
    hanging_target = FakeConfig(ttft_s=5.0)
    async with fleet(FakeConfig(tpot_s=0.01), hanging_target, **FORCED,
                     policy={"name": "round_robin"}) as (proxy, fakes):
        async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as http:
            async with http.stream("POST", "/v1/chat/completions", json={
                    **CHAT, "stream": True, "max_tokens": 500},
                    headers={"x-laneway-migrate-after": "3"}) as response:
                async for _ in response.aiter_bytes():
                    if fakes[1].app.stats.requests:
                        break  # the target is prefilling: leave now
        for _ in range(100):
            if fakes[0].app.stats.running == fakes[1].app.stats.running == 0:
                break
            await asyncio.sleep(0.02)
    assert fakes[0].app.stats.cancelled == 1
    assert fakes[1].app.stats.running == 0


async def test_requests_that_cannot_move_are_relayed_as_bytes() -> None:
    async with fleet(FakeConfig(), FakeConfig(), **FORCED) as (proxy, fakes):
        response = await post(proxy, {**CHAT, "stream": True, "max_tokens": 5, "n": 2},
                              headers={"x-laneway-migrate-after": "1"})
    assert response.status_code == 200
    sent = [b for f in fakes for b in f.app.stats.bodies]
    assert len(sent) == 1 and "return_token_ids" not in sent[0]


class MoveToOther:
    """A test policy: round robin, and every check moves the stream to another backend."""

    name = "test_move_every_check"
    Params = NoParams

    def __init__(self, params: NoParams) -> None:
        self.checks: list[Progress] = []
        self.outcomes: list[Outcome] = []

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        return Decision(view.candidates[0], "first")

    def reroute(self, ctx: RequestContext, pred: Prediction, progress: Progress,
                view: ClusterView) -> Decision | None:
        self.checks.append(progress)
        return Decision(view.candidates[0], "test") if len(self.checks) == 1 else None

    def observe(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


if MoveToOther.name not in POLICIES:
    register(MoveToOther)


async def test_rerouting_policy_is_asked_every_tau_tokens_and_can_move() -> None:
    async with fleet(FakeConfig(tpot_s=0.005), FakeConfig(),
                     policy={"name": MoveToOther.name},
                     migration={"check_every_tokens": 10}) as (proxy, fakes):
        response = await post(proxy, {**CHAT, "max_tokens": 35})  # non-streamed: tracked too
        policy = proxy.app.runtime.router.policy  # type: ignore[union-attr]
    assert response.json()["choices"][0]["message"]["content"] == expected_text(35)
    assert [p.generated >= 10 * (i + 1) for i, p in enumerate(policy.checks)] == [True] * 3
    assert policy.checks[0].backend.name == "f0" and policy.checks[1].backend.name == "f1"
    assert len(continuation_bodies(fakes[1])) == 1
    moved, final = policy.outcomes
    assert (moved.backend, moved.moved_to, final.backend, final.migrations) == (
        "f0", "f1", "f1", 1)


async def test_move_to_another_tokenizer_retokenizes_prompt_and_text() -> None:
    async with fleet(FakeConfig(tpot_s=0.03), FakeConfig(), **FORCED) as (proxy, fakes):
        runtime = proxy.app.runtime
        assert runtime is not None
        other = runtime.registry.remove("f1")
        runtime.registry.add(dataclasses.replace(
            other, labels=MappingProxyType({"tokenizer": "another-bpe"})))
        runtime.registry.publish(runtime.registry.stats)
        response = await post(proxy, {**CHAT, "stream": True, "max_tokens": 12},
                              headers={"x-laneway-migrate-after": "5",
                                       "x-laneway-events": "1"})
    assert stream_text(response) == expected_text(12)
    (moved,) = migrated_comments(response)
    at = moved["at_token"]  # 5, or later if the warm-up took longer than a token
    prompt_call, text_call = fakes[1].app.stats.tokenized[-2:]
    assert prompt_call["messages"] == CHAT["messages"] and prompt_call["add_generation_prompt"]
    assert text_call == {"model": "fake", "prompt": expected_text(at),
                         "add_special_tokens": False}
    (cont,) = continuation_bodies(fakes[1])
    assert cont["max_tokens"] == 12 - at


async def _event_times(proxy: Any, body: dict[str, Any], headers: dict[str, str]
                       ) -> tuple[list[float], str]:
    times, text = [], []
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body,
                               headers=headers) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    times.append(asyncio.get_running_loop().time())
                if line.startswith((": laneway", "data: {")):
                    text.append(line)
    return times, "\n".join(text)


@pytest.mark.parametrize("greedy", [True, False], ids=["paced", "frozen"])
async def test_paced_handoff_hides_the_targets_startup(greedy: bool,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="laneway")
    source, slow_start = FakeConfig(tpot_s=0.01), FakeConfig(tpot_s=0.01, ttft_s=0.3)
    async with fleet(source, slow_start, **FORCED,
                     migration={"warm_prefill": False, "pace_slowdown": 0.4}) as (proxy, _):
        body = {**CHAT, "stream": True, "max_tokens": 250,
                **({"temperature": 0} if greedy else {})}
        times, text = await _event_times(proxy, body, {"x-laneway-migrate-after": "10",
                                                       "x-laneway-events": "1"})
    assert text.count(": laneway") == 1 and text.count('"finish_reason":"length"') == 1
    gaps = [b - a for a, b in itertools.pairwise(times[2:])]
    if greedy:  # shown at 14 ms per token while the target starts: no 300 ms hole
        assert max(gaps) < 0.15, max(gaps)
        # the cut's log line says how long the pace ran and what set it
        (line,) = [r.getMessage() for r in caplog.records if "caught up" in r.getMessage()]
        found = re.search(r"(\d+) pieces paced at ([\d.]+) ms \(TPOT source ([\d.]+) ms, "
                          r"target ([\d.]+) ms\)", line)
        assert found is not None, line
        paced, pace_ms, source_ms, target_ms = (float(g) for g in found.groups())
        assert paced >= 15  # 0.3 s of start-up at ~14 ms per piece
        assert pace_ms == pytest.approx(1.4 * max(source_ms, target_ms), abs=0.15)
    else:  # frozen: the client waits for the target's whole start-up
        assert max(gaps) >= 0.3


async def test_a_stream_moves_between_the_models_of_a_group() -> None:
    """Members of a model group are other models: the move re-tokenizes on the target
    and asks it for its own model name."""
    source, target = FakeConfig(model="a", tpot_s=0.01), FakeConfig(model="b")
    async with fleet(source, target, model_groups={"team": ["a", "b"]},
                     **FORCED) as (proxy, fakes):
        response = await post(proxy, {**CHAT, "model": "team", "stream": True,
                                      "max_tokens": 12},
                              headers={"x-laneway-migrate-after": "5",
                                       "x-laneway-events": "1"})
    assert stream_text(response) == expected_text(12)
    (moved,) = migrated_comments(response)
    assert fakes[1].app.stats.tokenized[-1]["model"] == "b"
    (cont,) = continuation_bodies(fakes[1])
    assert cont["model"] == "b" and cont["max_tokens"] == 12 - moved["at_token"]
    data = [orjson.loads(e) for e in events(response.text)[:-1]]
    assert {d["model"] for d in data} == {"a"}  # one response, as the first backend named it


async def test_a_move_the_source_outruns_is_dropped_and_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    """The source finishes while the target is still warming up: the stream ends whole
    on the source, the move is logged as dropped, and the target's warm-up is cancelled."""
    caplog.set_level(logging.INFO, logger="laneway")
    source, slow_start = FakeConfig(tpot_s=0.01), FakeConfig(ttft_s=2.0)
    async with fleet(source, slow_start, **FORCED) as (proxy, fakes):
        response = await post(proxy, {**CHAT, "stream": True, "max_tokens": 12},
                              headers={"x-laneway-migrate-after": "3",
                                       "x-laneway-events": "1"})
        for _ in range(100):  # the cancel reaches the target just after the last write
            if fakes[1].app.stats.cancelled:
                break
            await asyncio.sleep(0.01)
        assert fakes[1].app.stats.cancelled == 1
    assert stream_text(response) == expected_text(12)
    assert migrated_comments(response) == []
    assert response.headers["x-laneway-backend"] == "f0"
    (line,) = [r.getMessage() for r in caplog.records if "move dropped" in r.getMessage()]
    assert re.search(r": finished on f0 before f1 was ready; move dropped \(forced, [\d.]+ ms\)",
                     line), line
    (warm,) = continuation_bodies(fakes[1], warm=True)
    assert warm["max_tokens"] == 1 and continuation_bodies(fakes[1]) == []


@pytest.mark.parametrize(("path", "fields", "tokens"), [
    ("/v1/completions", {}, 16),  # vLLM's default max_tokens
    ("/v1/chat/completions", {"max_tokens": 5, "max_completion_tokens": 12}, 12),
], ids=["completions-default", "chat-max-completion-tokens"])
async def test_a_move_keeps_the_length_bound_the_backend_applies(
        path: str, fields: dict[str, int], tokens: int) -> None:
    """The continuation asks for what is left of the bound the source was applying."""
    chat = path.endswith("chat/completions")
    body = {**(CHAT if chat else COMPLETION), **fields, "stream": True}
    paced = FakeConfig(tpot_s=0.02)  # the target's warm-up ends before the source does
    async with fleet(paced, paced, **FORCED) as (proxy, fakes):
        response = await post(proxy, body, path, headers={"x-laneway-migrate-after": "3",
                                                          "x-laneway-events": "1"})
    assert stream_text(response, chat=chat) == expected_text(tokens)
    (moved,) = migrated_comments(response)
    target = fakes[1] if moved["to"] == "f1" else fakes[0]
    (cont,) = continuation_bodies(target)
    assert cont["max_tokens"] == tokens - moved["at_token"]


@pytest.mark.parametrize("discovery", [True, False], ids=["context-listed", "unknown"])
async def test_a_chat_without_a_bound_moves_with_the_targets_context(
        discovery: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A continuation without max_tokens would stop at 16: it asks for the target's
    context length (its /v1/models), which the server bounds by the room left. Unknown
    (model lists not read), the move is declined and the stream ends on its source."""
    caplog.set_level(logging.INFO, logger="laneway")
    small = FakeConfig(tpot_s=0.01, max_model_len=64, default_tokens=1000)  # to the end
    poller = {"models_interval_s": 3600 if discovery else 0}
    async with fleet(small, small, poller=poller, **FORCED) as (proxy, fakes):
        alone = await post(proxy, {**CHAT, "stream": True})
        response = await post(proxy, {**CHAT, "stream": True},
                              headers={"x-laneway-migrate-after": "3", "x-laneway-events": "1"})
    tokens = len(stream_text(alone).split())
    assert tokens > 16 and stream_text(response) == expected_text(tokens)
    if discovery:
        (moved,) = migrated_comments(response)
        target = fakes[1] if moved["to"] == "f1" else fakes[0]
        (cont,) = continuation_bodies(target)
        assert cont["max_tokens"] == 64
    else:
        assert migrated_comments(response) == []
        assert any("context length is unknown" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("forced_first", [True, False], ids=["from-forced", "to-forced"])
async def test_usage_in_every_chunk_is_as_the_first_server_puts_it(forced_first: bool) -> None:
    """A server with --enable-force-include-usage puts usage in every chunk: a tracked
    stream that starts there does too, counted across a move to a server without the
    flag; one that starts on a server without it does not start when it moves."""
    forced, plain = FakeConfig(tpot_s=0.02, force_usage=True), FakeConfig(tpot_s=0.02)
    # no warm-up: the splice is where the header asks (with one, it waits for the
    # warm-up's answer, under CI's load once a token later)
    async with fleet(*((forced, plain) if forced_first else (plain, forced)),
                     migration={"warm_prefill": False}, **FORCED) as (proxy, _):
        response = await post(proxy, {**CHAT, "stream": True, "max_tokens": 8},
                              headers={"x-laneway-migrate-after": "3", "x-laneway-events": "1"})
    assert response.headers["x-laneway-backend"] == "f0"
    assert [m["at_token"] for m in migrated_comments(response)] == [3]
    data = [orjson.loads(e) for e in events(response.text)[:-1]]
    tokens = [d for d in data if d["choices"] and "role" not in d["choices"][0]["delta"]]
    counts = [d["usage"]["completion_tokens"] if "usage" in d else None for d in tokens]
    if forced_first:
        assert counts == list(range(1, 9)) and data[-1]["usage"]["completion_tokens"] == 8
    else:
        assert counts == [None] * 8 and "usage" not in data[-1]
    assert stream_text(response) == expected_text(8)


@pytest.mark.parametrize("after", [0, 3], ids=["first-event", "mid-stream"])
async def test_a_backends_refusal_is_the_clients_answer(after: int) -> None:
    """A 4xx error event (vLLM validates some requests only once it streams) is the
    client's error: relayed as the backend put it, not retried or continued elsewhere
    (before: a 502 after trying every backend, or a continuation)."""
    async with fleet(FakeConfig(refuse_after_tokens=after),
                     FakeConfig(refuse_after_tokens=after),
                     migration={"non_stream": True}) as (proxy, fakes):
        stream = await post(proxy, {**CHAT, "stream": True, "max_tokens": 10})
        whole = await post(proxy, {**CHAT, "max_tokens": 10})
        metrics = (await httpx.AsyncClient().get(f"{proxy.url}/metrics")).text
    assert stream.status_code == 200
    data = events(stream.text)
    assert data[-1] == "[DONE]" and orjson.loads(data[-2]) == orjson.loads(REFUSAL)
    assert stream_text_until_error(data) == expected_text(after)
    assert whole.status_code == 400 and whole.json() == orjson.loads(REFUSAL)
    assert whole.headers["x-laneway-backend"] in ("f0", "f1")
    assert [f.app.stats.requests for f in fakes] == [1, 1]  # one each: round robin
    assert "laneway_retries_total{" not in metrics
    assert metrics.count('status="400"} 1.0') == 2  # one per backend
