"""The Responses API (`/v1/responses`) through the proxy: routed by the policy, streams
relayed to their own end event, stored responses found on the backend that holds them."""

from __future__ import annotations

import re

import httpx
import pytest

from bench.fakes.fake_vllm import FakeConfig
from proxy.state.response_homes import ResponseHomes
from tests.proxy.admission.test_auth import bearer, keys
from tests.proxy.fakes import charged, fleet, post

ASK = {"model": "fake", "input": "hello there", "max_output_tokens": 4}


async def test_a_response_is_routed_relayed_and_counted() -> None:
    async with fleet(FakeConfig(), FakeConfig(), auth=keys(tokens_per_minute=10_000)) as (
            proxy, fakes):
        rt = proxy.app.runtime
        assert rt is not None
        answers = [await post(proxy, ASK, "/v1/responses", headers=bearer("sk-alice"))
                   for _ in range(2)]
        used = charged(rt.auth.limiter, "alice:tokens")
        metrics = rt.metrics.render().decode()
    assert [a.status_code for a in answers] == [200, 200]
    assert {a.headers["x-laneway-backend"] for a in answers} == {"f0", "f1"}  # round robin
    usage = answers[0].json()["usage"]
    assert used == pytest.approx(2 * (usage["input_tokens"] + usage["output_tokens"]), abs=1e-3)
    assert fakes[0].app.stats.bodies == [ASK]  # the original body, untouched
    assert 'laneway_requests_total{backend="f0",model="fake",policy="round_robin",' \
        'status="200"} 1.0' in metrics
    assert len(rt.responses) == 2  # both ids remembered with their backend


async def test_a_stream_ends_with_its_own_end_event_not_done() -> None:
    async with fleet(FakeConfig(tpot_s=0.002)) as (proxy, fakes):
        rt = proxy.app.runtime
        assert rt is not None
        async with httpx.AsyncClient() as http:
            direct = (await http.post(f"{fakes[0].url}/v1/responses",
                                      json={**ASK, "stream": True})).text
        answer = await post(proxy, {**ASK, "stream": True}, "/v1/responses")
        metrics = rt.metrics.render().decode()
    assert answer.status_code == 200
    # The same events as the backend's (only the stored id's counter differs).
    assert re.sub("resp_[0-9a-f]+_1", "", answer.text) == re.sub("resp_[0-9a-f]+_0", "", direct)
    assert answer.text.rstrip().endswith('"type":"response.completed"}')
    assert "[DONE]" not in answer.text and "event: error" not in answer.text
    assert 'laneway_tpot_seconds_count{backend="f0",model="fake",policy="round_robin"} 1.0' \
        in metrics  # counted as a finished stream of four tokens


async def test_a_stream_cut_mid_way_ends_with_a_responses_error_event() -> None:
    async with fleet(FakeConfig(die_after_tokens=2)) as (proxy, _):
        answer = await post(proxy, {**ASK, "stream": True}, "/v1/responses")
    events = answer.text.strip().split("\n\n")
    assert events[-1].startswith("event: error\ndata: ")
    assert '"type":"error","code":"upstream_failed"' in events[-1]
    assert sum("response.output_text.delta" in e for e in events) == 2


async def test_previous_response_id_goes_where_that_response_is_stored() -> None:
    async with fleet(FakeConfig(), FakeConfig(), FakeConfig()) as (proxy, fakes):
        rt = proxy.app.runtime
        assert rt is not None
        first = await post(proxy, ASK, "/v1/responses")
        home = first.headers["x-laneway-backend"]
        chain = [first]
        for _ in range(3):  # round robin alone would move on every time
            chain.append(await post(proxy, {**ASK, "previous_response_id":
                                            chain[-1].json()["id"]}, "/v1/responses"))
        rt.responses = type(rt.responses)()  # forgotten: another replica, a restart
        found = await post(proxy, {**ASK, "previous_response_id": chain[-1].json()["id"]},
                           "/v1/responses")
        unknown = await post(proxy, {**ASK, "previous_response_id": "resp_nowhere"},
                             "/v1/responses")
        # An id is one path segment on the way to the backends: no other route is asked.
        sneaky = await post(proxy, {**ASK, "previous_response_id": "../../health"},
                            "/v1/responses")
    assert [c.status_code for c in chain] == [200] * 4
    assert {c.headers["x-laneway-backend"] for c in chain} == {home}
    assert found.status_code == 200 and found.headers["x-laneway-backend"] == home
    assert unknown.status_code == 404  # the backend's verdict, relayed
    assert sneaky.status_code == 404
    assert rt.responses.get("../../health") is None  # /health answered no probe
    assert sum(f.app.stats.requests for f in fakes) == 7


async def test_stored_responses_are_read_and_cancelled_on_their_backend() -> None:
    async with fleet(FakeConfig(), FakeConfig(), auth=keys()) as (proxy, _):
        rt = proxy.app.runtime
        assert rt is not None
        made = [await post(proxy, ASK, "/v1/responses", headers=bearer("sk-alice"))
                for _ in range(2)]
        rt.responses = type(rt.responses)()  # not remembered: found by asking
        async with httpx.AsyncClient(base_url=proxy.url, headers=bearer("sk-alice")) as http:
            read = [await http.get(f"/v1/responses/{m.json()['id']}") for m in made]
            cancelled = await http.post(f"/v1/responses/{made[0].json()['id']}/cancel")
            with_query = await http.get(f"/v1/responses/{made[0].json()['id']}",
                                        params={"include[]": "message.output_text.logprobs"})
            missing = await http.get("/v1/responses/resp_nowhere")
            wrong_method = await http.post(f"/v1/responses/{made[0].json()['id']}")
            bad_path = await http.get(f"/v1/responses/{made[0].json()['id']}/other")
            denied = await http.get(f"/v1/responses/{made[0].json()['id']}",
                                    headers=bearer("sk-bob"))
            anonymous = await http.get(f"/v1/responses/{made[0].json()['id']}",
                                       headers={"authorization": ""})
            dots = [await http.get(path)  # ("/v1/responses/..", as httpx sends it)
                    for path in ("/v1/responses/%2E%2E", "/v1/responses/%2e")]
    lookups = rt.metrics.registry.get_sample_value(
        "laneway_response_home_lookups_total", {"found": "missing"})
    assert lookups == 1  # resp_nowhere's; ".." is a path, not an id to ask the backends for
    assert [r.json() for r in read] == [m.json() for m in made]
    assert [r.headers["x-laneway-backend"] for r in read] \
        == [m.headers["x-laneway-backend"] for m in made]
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert with_query.json()["query"] == "include%5B%5D=message.output_text.logprobs"
    for answer, status, code in ((missing, 404, "not_found"),
                                 (wrong_method, 405, "method_not_allowed"),
                                 (bad_path, 404, "not_found"),
                                 # (bob's models' backends are the only ones
                                 # asked: another model's response is not found)
                                 (denied, 404, "not_found"),
                                 (anonymous, 401, "invalid_api_key"),
                                 *((answer, 404, "not_found") for answer in dots)):
        assert answer.status_code == status
        assert answer.json()["error"]["code"] == code


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "fake", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "fake", "input": "x", "max_output_tokens": "four"}, "max_output_tokens"),
    ],
)
async def test_bad_responses_requests_are_400_before_any_backend(
        body: dict[str, object], param: str) -> None:
    async with fleet(FakeConfig()) as (proxy, fakes):
        answer = await post(proxy, body, "/v1/responses")
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == param
    assert fakes[0].app.stats.requests == 0


def test_input_items_the_proxy_cannot_read_are_the_backends_to_judge() -> None:
    from proxy.request_context import build_context

    # vLLM takes [] and {} after instructions, refuses ["x"], 5 and no input
    for items in ([], ["x", 5], {}, 5, None):
        ctx = build_context({"model": "m", "instructions": "Be brief.", "input": items},
                            "responses", {}, request_id="r", max_tokens_limit=100,
                            session_header="x-session-id", block_chars=8)
        assert ctx.prompt_text == "system: Be brief."


def test_the_prompt_of_input_items_is_their_text() -> None:
    from proxy.request_context import build_context

    data = {"model": "m", "instructions": "Be brief.", "input": [
        {"role": "user", "content": "first"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "answer"}]},
        {"type": "function_call_output", "call_id": "c1", "output": "42"}]}
    ctx = build_context(data, "responses", {}, request_id="r", max_tokens_limit=100,
                        session_header="x-session-id", block_chars=8)
    assert ctx.prompt_text == ("system: Be brief.\nuser: first\nassistant: answer\n"
                               "function_call_output: 42")


async def test_a_key_for_a_model_group_reads_its_members_responses() -> None:
    from proxy.hashing import hash_key

    auth = {"enabled": True, "keys": [
        {"name": "carol", "sha256": hash_key("sk-carol"), "models": ["team"]}]}
    async with fleet(FakeConfig(model="a"), auth=auth, model_groups={"team": ["a"]}) as (
            proxy, _):
        made = await post(proxy, {**ASK, "model": "team"}, "/v1/responses",
                          headers=bearer("sk-carol"))
        async with httpx.AsyncClient(base_url=proxy.url, headers=bearer("sk-carol")) as http:
            read = await http.get(f"/v1/responses/{made.json()['id']}")
    assert made.json()["model"] == "a"  # the member that served it
    assert read.status_code == 200 and read.json() == made.json()


async def test_a_streamed_retrieval_is_relayed_as_it_streams() -> None:
    async with fleet(FakeConfig(tpot_s=0.002), FakeConfig(die_after_tokens=1)) as (
            proxy, fakes):
        made = [await post(proxy, ASK, "/v1/responses") for _ in range(2)]
        ok, cut = sorted(made, key=lambda m: m.headers["x-laneway-backend"])
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            direct = await http.get(f"{fakes[0].url}/v1/responses/{ok.json()['id']}",
                                    params={"stream": "true"})
            streamed = await http.get(f"/v1/responses/{ok.json()['id']}",
                                      params={"stream": "true"})
            broken = await http.get(f"/v1/responses/{cut.json()['id']}",
                                    params={"stream": "true"})
    assert streamed.headers["content-type"] == "text/event-stream"
    assert streamed.text == direct.text
    assert streamed.text.rstrip().endswith('"type":"response.completed"}')
    assert broken.headers["x-laneway-backend"] == "f1"
    assert broken.text.rstrip().split("\n\n")[-1].startswith("event: error\ndata: ")


async def test_a_streamed_retrieval_that_ends_without_its_end_event_is_broken() -> None:
    """A stream that ends cleanly before `response.completed` is not a finished answer:
    the client gets an error event, and the backend's failure is counted."""
    async with fleet(FakeConfig(end_after_tokens=2)) as (proxy, _):
        rt = proxy.app.runtime
        assert rt is not None
        made = await post(proxy, ASK, "/v1/responses")
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            cut = await http.get(f"/v1/responses/{made.json()['id']}",
                                 params={"stream": "true"})
        metrics = rt.metrics.render().decode()
    events = cut.text.strip().split("\n\n")
    assert cut.status_code == 200
    assert sum("response.output_text.delta" in e for e in events) == 2
    assert events[-1].startswith("event: error\ndata: ")
    assert "failed mid-stream (broken)" in events[-1]  # (the detail is in the log)
    assert 'laneway_upstream_errors_total{backend="f0",kind="broken"} 1.0' in metrics


def test_homes_learned_here_are_exported_once_and_merged_ones_not_again() -> None:
    homes = ResponseHomes(capacity=3)
    assert homes.export_updates() == []
    homes.learn("resp_a", "b0")
    homes.learn("resp_b", "b1")
    assert homes.export_updates() == [["resp_a", "b0"], ["resp_b", "b1"]]
    assert homes.export_updates() == []  # each write goes out once
    homes.merge_updates([["resp_c", "b2"], ["resp_d"], "resp_e", [1, "b0"], ["resp_f", None]])
    assert homes.export_updates() == []  # another replica's writes are not sent back
    assert (homes.get("resp_c"), homes.get("resp_e"), len(homes)) == ("b2", None, 3)
    assert homes.get("resp_a") == "b0"  # read: now the most recently used
    homes.merge_updates([["resp_g", "b0"]])  # capacity 3: the least recently used goes
    assert (homes.get("resp_b"), homes.get("resp_a"), homes.get("resp_g")) == (
        None, "b0", "b0")
    for i in range(5):  # nobody exports (no replicator): the backlog stays bounded
        homes.learn(f"resp_{i}", "b1")
    assert homes.export_updates() == [[f"resp_{i}", "b1"] for i in range(2, 5)]
