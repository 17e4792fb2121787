"""TLS on both sides: the proxy serving HTTPS (`server.tls_certfile`/`tls_keyfile`) and
`https://` backends verified against a private CA (`upstream.tls_ca_file`), with real
certificates (trustme makes a CA and signs a certificate for 127.0.0.1)."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import trustme
import uvicorn

from bench.fakes.fake_vllm import FakeConfig, FakeVllm
from bench.harness.proxy_process import running_proxy
from bench.harness.services import running_fakes
from proxy.config import ConfigError, load_settings
from proxy.http.server import uvicorn_in_loop
from tests.proxy.fakes import ADMIN, CHAT, fleet


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def pem(ca: trustme.CA, tmp_path: Path) -> Iterator[dict[str, str]]:
    """The CA's certificate and 127.0.0.1's certificate chain and key, as PEM files."""
    cert = ca.issue_cert("127.0.0.1")
    files = {"ca": tmp_path / "ca.pem", "cert": tmp_path / "cert.pem",
             "key": tmp_path / "key.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    cert.private_key_pem.write_to_path(str(files["key"]))
    for blob in cert.cert_chain_pems:
        blob.write_to_path(str(files["cert"]), append=True)
    yield {k: str(v) for k, v in files.items()}


@contextlib.asynccontextmanager
async def tls_fake(pem: dict[str, str]) -> AsyncIterator[tuple[str, FakeVllm]]:
    """A fake vLLM serving HTTPS with `pem`'s certificate."""
    app = FakeVllm(FakeConfig())
    config = uvicorn.Config(app, host="127.0.0.1", port=0, loop="none", lifespan="off",
                            log_config=None, ssl_certfile=pem["cert"],
                            ssl_keyfile=pem["key"])
    async with uvicorn_in_loop(config) as url:
        yield url, app


async def test_the_proxy_serves_https(pem: dict[str, str]) -> None:
    server = {"tls_certfile": pem["cert"], "tls_keyfile": pem["key"]}
    async with fleet(FakeConfig(), server=server) as (proxy, fakes):
        assert proxy.url.startswith("https://")
        trusted = ssl.create_default_context(cafile=pem["ca"])
        async with httpx.AsyncClient(base_url=proxy.url, verify=trusted) as http:
            answer = await http.post("/v1/chat/completions", json=CHAT)
        async with httpx.AsyncClient(base_url=proxy.url) as untrusting:
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await untrusting.get("/health")
    assert answer.status_code == 200 and fakes[0].app.stats.requests == 1


def test_laneway_serve_serves_https(pem: dict[str, str]) -> None:
    """The same through `laneway serve` in a process of its own, as deployed."""
    with running_fakes(1) as urls, running_proxy({
            "backends": [{"name": "f0", "url": urls[0], "model": "fake"}],
            "server": {"tls_certfile": pem["cert"], "tls_keyfile": pem["key"]},
            "policy": {"name": "round_robin"}}) as proxy:
        assert proxy.url.startswith("https://")
        with httpx.Client(base_url=proxy.url, verify=ssl.create_default_context(
                cafile=pem["ca"])) as http:
            answer = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
            health = http.get("/health")
        with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP to the TLS port
            httpx.get(proxy.url.replace("https://", "http://") + "/health")
    assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
    assert health.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_https_backends_are_verified_against_the_configured_ca(
        pem: dict[str, str], stream: bool) -> None:
    async with tls_fake(pem) as (url, app), fleet(
            extra_backends=[{"name": "tls", "url": url, "model": "fake"}],
            upstream={"tls_ca_file": pem["ca"]}) as (proxy, _):
        assert url.startswith("https://")
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            health = (await http.get("/admin/health", headers=ADMIN)).json()
            answer = await http.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert answer.status_code == 200 and answer.headers["x-laneway-backend"] == "tls"
    assert app.stats.requests == 1
    assert health["backends"]["tls"]["healthy"]  # scraped over TLS too


async def test_an_https_backend_of_an_unknown_ca_is_not_trusted(pem: dict[str, str]) -> None:
    async with tls_fake(pem) as (url, app), fleet(
            extra_backends=[{"name": "tls", "url": url, "model": "fake"}]) as (proxy, _):
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            answer = await http.post("/v1/chat/completions", json=CHAT)
            health = (await http.get("/admin/health", headers=ADMIN)).json()
    assert answer.status_code in (502, 503)
    assert not health["backends"]["tls"]["healthy"]
    assert app.stats.requests == 0


def test_tls_files_that_do_not_load_stop_the_config(pem: dict[str, str],
                                                    tmp_path: Path) -> None:
    config = tmp_path / "laneway.yaml"
    cases = {
        f"server: {{tls_certfile: {pem['cert']}}}": "set both or neither",
        f"server: {{tls_certfile: {pem['cert']}, tls_keyfile: {pem['ca']}}}":
            "server.tls_certfile/tls_keyfile: cannot load",
        f"upstream: {{tls_ca_file: {tmp_path / 'missing.pem'}}}":
            "upstream.tls_ca_file: cannot load",
    }
    for text, message in cases.items():
        config.write_text(text + "\nbackends: [{name: a, url: 'http://127.0.0.1:9', model: m}]\n")
        with pytest.raises(ConfigError, match=message):
            load_settings(config)
    config.write_text(f"server: {{tls_certfile: {pem['cert']}, tls_keyfile: {pem['key']}}}\n"
                      f"upstream: {{tls_ca_file: {pem['ca']}}}\n")
    assert load_settings(config).server.tls_certfile == pem["cert"]
