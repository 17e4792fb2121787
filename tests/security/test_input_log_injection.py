"""Item 9: what a client sends (the decoded path, the body's model) cannot forge lines
in the text log: control characters are escaped, and a field cannot add fields."""

from __future__ import annotations

from pathlib import Path

import httpx

from bench.harness.proxy_process import running_proxy
from tests.security.input_helpers import CHAT, fake_url, proxy_config, raw_exchange, status_of

__all__ = ["fake_url"]


def test_client_text_cannot_forge_log_lines(fake_url: str, tmp_path: Path) -> None:
    log = tmp_path / "proxy.log"
    config = proxy_config(fake_url, server={"access_log": True})
    with running_proxy(config, log_path=log) as proxy:
        answer = raw_exchange(proxy.url, b"GET /v1/models%0aFORGED-PATH%0d%1b[2K HTTP/1.1"
                              b"\r\nhost: x\r\n\r\n")
        assert status_of(answer) == 404
        model = 'x\nFORGED-MODEL\u2028 z" client="6.6.6.6'
        refused = httpx.post(proxy.url + "/v1/chat/completions", timeout=10,
                             json={**CHAT, "model": model})
        assert refused.status_code == 404
    lines = log.read_text().splitlines()
    assert not [line for line in lines if "FORGED" in line and " laneway" not in line]
    assert not any("\x1b" in line for line in lines)
    assert not any('client="6.6.6.6"' in line for line in lines)
    assert any("FORGED-PATH" in line for line in lines)  # logged, on its own line
