"""CORS for browser clients (`server.cors_allow_origins`)."""

from __future__ import annotations

import httpx

from bench.fakes.fake_vllm import FakeConfig
from tests.proxy.fakes import CHAT, fleet

APP = "https://app.example"
PREFLIGHT = {"origin": APP, "access-control-request-method": "POST",
             "access-control-request-headers": "authorization, content-type"}


async def test_an_allowed_origin_gets_its_preflight_and_headers_on_every_answer() -> None:
    async with fleet(FakeConfig(), server={"cors_allow_origins": [APP + "/"]}) as (
            proxy, fakes):
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            preflight = await http.options("/v1/chat/completions", headers=PREFLIGHT)
            answer = await http.post("/v1/chat/completions", json=CHAT,
                                     headers={"origin": APP})
            async with http.stream("POST", "/v1/chat/completions",
                                   json={**CHAT, "stream": True},
                                   headers={"origin": APP}) as streamed:
                await streamed.aread()
            refused = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": -1},
                                      headers={"origin": APP})
            other = await http.post("/v1/chat/completions", json=CHAT,
                                    headers={"origin": "https://evil.example"})
            other_preflight = await http.options("/v1/chat/completions",
                                                 headers={**PREFLIGHT, "origin": "https://x"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == APP
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    for response in (answer, streamed, refused):
        assert response.headers["access-control-allow-origin"] == APP
        assert "x-laneway-backend" in response.headers["access-control-expose-headers"]
        assert response.headers["vary"] == "Origin"
    assert answer.status_code == 200 and refused.status_code == 400
    assert "access-control-allow-origin" not in other.headers  # the browser blocks it
    assert other_preflight.status_code == 405  # not answered as a preflight
    assert fakes[0].app.stats.requests == 3  # a preflight never reaches a backend


async def test_any_origin_with_a_star_and_none_by_default() -> None:
    async with fleet(FakeConfig(), server={"cors_allow_origins": ["*"]}) as (proxy, _):
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            star = await http.post("/v1/chat/completions", json=CHAT,
                                   headers={"origin": "https://any.example"})
    async with fleet(FakeConfig()) as (proxy, _):
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            default = await http.post("/v1/chat/completions", json=CHAT,
                                      headers={"origin": APP})
            preflight = await http.options("/v1/chat/completions", headers=PREFLIGHT)
    assert star.headers["access-control-allow-origin"] == "https://any.example"
    assert "access-control-allow-origin" not in default.headers
    assert preflight.status_code == 405
