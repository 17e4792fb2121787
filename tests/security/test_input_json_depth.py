"""Item 8: a body nested deeper than `server.max_json_depth` is a 400 in OpenAI's shape,
not a 500 with a traceback (orjson reads 1024 levels but writes only 254)."""

from __future__ import annotations

from pathlib import Path

import httpx

from bench.harness.proxy_process import running_proxy
from tests.security.input_helpers import fake_url, proxy_config

__all__ = ["fake_url"]


def _nested(depth: int) -> bytes:
    return (b'{"model": "fake", "stream": true, "messages": [{"role": "user", "content": '
            b'"hi"}], "x": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}")


def test_deep_json_is_a_400_without_a_traceback(fake_url: str, tmp_path: Path) -> None:
    log = tmp_path / "proxy.log"
    with running_proxy(proxy_config(fake_url), log_path=log) as proxy:
        for path in ("/v1/chat/completions", "/v1/embeddings"):
            answer = httpx.post(proxy.url + path, content=_nested(300), timeout=10,
                                headers={"content-type": "application/json"})
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["type"] == "invalid_request_error"
        shallow = httpx.post(proxy.url + "/v1/chat/completions", content=_nested(20),
                             timeout=10)
        assert shallow.status_code == 200  # what the fake makes of `x`: nothing
    assert "Traceback" not in log.read_text()
