"""The length predictor's error in /metrics: for each request that finished with an
arrival prediction, predicted / true completion tokens and |predicted - true|."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.fakes.fake_vllm import FakeConfig
from predictors.length.predictor import load_artifact
from proxy.request_context import build_context
from tests.predictors.helpers import tiny_length_artifact
from tests.proxy.fakes import fleet, post

PROMPTS = ["write an essay about bees", "name one fact about chess", "give a list of rivers"]


def body(prompt: str, stream: bool) -> dict[str, object]:
    return {"model": "fake", "messages": [{"role": "user", "content": prompt}],
            "stream": stream, "max_tokens": 40}


def samples(text: str) -> dict[tuple[str, str | None], float]:
    return {(s.name, s.labels.get("le")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.labels.get("model") == "fake"}


async def test_finished_requests_report_how_far_the_prediction_was(tmp_path: Path) -> None:
    artifact = tiny_length_artifact(tmp_path)
    predictor = load_artifact(artifact)
    expected = []
    for prompt in PROMPTS:  # as the proxy sees the request (its own parsing code)
        ctx = build_context(body(prompt, False), "chat", {}, request_id="x",
                            max_tokens_limit=131_072, session_header="x-session-id",
                            block_chars=128)
        predicted = predictor.predict(ctx).output_tokens
        assert predicted is not None
        expected.append(predicted)
    async with fleet(FakeConfig(), predictors={"length": {"artifact": str(artifact)}}) \
            as (proxy, _):
        for prompt, stream in zip(PROMPTS, (False, True, True), strict=True):
            response = await post(proxy, body(prompt, stream))
            assert response.status_code == 200
        failed = await post(proxy, {**body("name one fact about bees", False),
                                    "model": "nope"})  # 404: never routed, not counted
        text = (await httpx.AsyncClient().get(f"{proxy.url}/metrics")).text
    assert failed.status_code == 404
    got = samples(text)
    assert got[("laneway_length_prediction_error_tokens_count", None)] == 3
    assert got[("laneway_length_prediction_error_tokens_sum", None)] == pytest.approx(
        sum(abs(p - 40) for p in expected), rel=1e-6)  # the fake answers max_tokens
    assert got[("laneway_length_prediction_ratio_sum", None)] == pytest.approx(
        sum(p / 40 for p in expected), rel=1e-6)
    within = sum(0.75 < p / 40 <= 1.25 for p in expected)
    assert got[("laneway_length_prediction_ratio_bucket", "1.25")] \
        - got[("laneway_length_prediction_ratio_bucket", "0.75")] == within


async def test_no_predictor_no_length_series() -> None:
    async with fleet(FakeConfig()) as (proxy, _):
        assert (await post(proxy, body("hi", False))).status_code == 200
        text = (await httpx.AsyncClient().get(f"{proxy.url}/metrics")).text
    assert ("laneway_length_prediction_error_tokens_count", None) not in samples(text)
