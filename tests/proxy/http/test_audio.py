"""`/v1/audio/transcriptions` and `/translations`: form uploads routed by their `model`
field (proxy/http/multipart.py, proxy/http/passthrough_routes.py), the upload relayed whole."""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

import httpx
import orjson
import pytest

from bench.fakes.fake_vllm import FakeConfig
from proxy.errors import InvalidRequest
from proxy.http import multipart
from tests.proxy.fakes import fleet

AUDIO = os.urandom(200_000) + b"\r\n--not-the-boundary\r\n" + os.urandom(1000)
WHISPER = FakeConfig(model="whisper")


async def _upload(proxy: Any, path: str = "/v1/audio/transcriptions",
                  **fields: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as http:
        return await http.post(path, data=fields, files={"file": ("a.wav", AUDIO, "audio/wav")})


async def test_an_upload_goes_to_a_backend_of_its_model_untouched() -> None:
    async with fleet(FakeConfig(), WHISPER, WHISPER) as (proxy, fakes):
        answers = [await _upload(proxy, model="whisper", language="en") for _ in range(4)]
        translated = await _upload(proxy, "/v1/audio/translations", model="whisper")
    assert [a.status_code for a in answers] == [200] * 4
    assert {a.headers["x-laneway-backend"] for a in answers} == {"f1", "f2"}
    assert answers[0].json()["text"] == f"whisper heard {len(AUDIO)} bytes"
    bodies = [b for f in fakes[1:] for b in f.app.stats.bodies]
    assert {b["file_sha256"] for b in bodies} == {hashlib.sha256(AUDIO).hexdigest()}
    assert {b.get("language") for b in bodies[:4]} <= {"en", None}
    assert translated.status_code == 200 and fakes[0].app.stats.requests == 0


async def test_a_group_member_gets_the_upload_under_its_own_name() -> None:
    async with fleet(WHISPER, model_groups={"speech": ["whisper"]}) as (proxy, fakes):
        answer = await _upload(proxy, model="speech")
    assert answer.status_code == 200
    assert answer.json()["text"] == f"whisper heard {len(AUDIO)} bytes"
    assert fakes[0].app.stats.bodies[0]["file_sha256"] == hashlib.sha256(AUDIO).hexdigest()


@pytest.mark.parametrize(("fields", "json_body", "status", "words"), [
    ({}, None, 400, "form field `model`"),
    ({"model": "nope"}, None, 404, "nope"),
    (None, {"model": "whisper"}, 400, "multipart/form-data"),
])
async def test_a_bad_upload_is_a_clear_error(fields: dict[str, str] | None,
                                             json_body: dict[str, str] | None,
                                             status: int, words: str) -> None:
    async with fleet(WHISPER) as (proxy, fakes):
        if json_body is not None:
            async with httpx.AsyncClient(base_url=proxy.url) as http:
                answer = await http.post("/v1/audio/transcriptions", json=json_body)
        else:
            answer = await _upload(proxy, **(fields or {}))
    assert answer.status_code == status
    assert words in answer.json()["error"]["message"]
    assert fakes[0].app.stats.requests == 0


def test_the_model_field_is_found_and_replaced_without_touching_the_file() -> None:
    request = httpx.Request("POST", "http://x", data={"model": "whisper", "x": "1"},
                            files={"file": ("a.wav", AUDIO, "audio/wav")})
    body = request.read()
    boundary = multipart.boundary_of(request.headers["content-type"])
    assert boundary is not None
    span = multipart.field_spans(body, boundary, "model").get("model")
    assert span is not None and body[span[0]:span[1]] == b"whisper"
    assert multipart.field_spans(body, boundary, "file").get("file") is None  # a file, not a field
    assert multipart.field_spans(body, boundary, "nope").get("nope") is None
    renamed = multipart.replaced(body, span, "whisper-large")
    again = multipart.field_spans(renamed, boundary, "model").get("model")
    assert again is not None and renamed[again[0]:again[1]] == b"whisper-large"
    assert AUDIO in renamed
    assert multipart.boundary_of("application/json") is None
    assert multipart.boundary_of('multipart/form-data; boundary="a b"') == b"a b"
    with pytest.raises(InvalidRequest):  # cut short: no form the backend could read
        multipart.field_spans(body[:100], boundary, "model")


async def test_a_streamed_transcription_is_relayed_as_it_streams() -> None:
    async with fleet(FakeConfig(model="whisper", tpot_s=0.2)) as (proxy, _), \
            httpx.AsyncClient(base_url=proxy.url, timeout=10) as http:
        arrivals: list[float] = []
        chunks: list[bytes] = []
        async with http.stream("POST", "/v1/audio/transcriptions",
                               data={"model": "whisper", "stream": "true"},
                               files={"file": ("a.wav", AUDIO, "audio/wav")}) as answer:
            started = asyncio.get_running_loop().time()
            async for chunk in answer.aiter_raw():
                arrivals.append(asyncio.get_running_loop().time() - started)
                chunks.append(chunk)
    body = b"".join(chunks)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "text/event-stream"
    assert "content-length" not in answer.headers
    words = [orjson.loads(line[6:])["choices"][0]["delta"]["content"]
             for line in body.split(b"\n\n") if line.startswith(b"data: {")]
    assert "".join(words) == f"whisper heard {len(AUDIO)} bytes "
    assert body.endswith(b"data: [DONE]\n\n")
    assert arrivals[0] < 0.15 < arrivals[-1]  # the first word came before the last was said


async def test_a_transcription_stream_that_ends_without_done_ends_with_an_error() -> None:
    async with fleet(FakeConfig(model="whisper", end_after_tokens=2)) as (proxy, _), \
            httpx.AsyncClient(base_url=proxy.url, timeout=10) as http:
        answer = await http.post("/v1/audio/transcriptions",
                                 data={"model": "whisper", "stream": "true"},
                                 files={"file": ("a.wav", AUDIO, "audio/wav")})
        rt = proxy.app.runtime
        assert rt is not None
        metrics = rt.metrics.render().decode()
    events = [e for e in answer.text.split("\n\n") if e]
    assert answer.status_code == 200
    assert len(events) == 4  # two words, the error, [DONE]
    assert orjson.loads(events[-2][6:])["error"]["code"] == "upstream_failed"
    assert events[-1] == "data: [DONE]"
    assert 'laneway_passthrough_requests_total{backend="f0",endpoint="/v1/audio/' \
        'transcriptions",model="whisper",status="502"} 1.0' in metrics
