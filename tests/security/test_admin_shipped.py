"""#71 part A: the configurations laneway ships are safe as shipped. The image's
default config (Dockerfile: deploy/laneway.example.yaml, bound to 0.0.0.0) serves no
admin API, the compose stack passes the token only from the operator's environment,
and its balancer does not publish /admin."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bench.harness.proxy_process import running_proxy
from tests.deploy.test_deploy_files import compose
from tests.security.admin_helpers import admin

REPO = Path(__file__).resolve().parents[2]


def test_the_images_default_config_serves_no_admin_api(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LANEWAY_ADMIN__TOKEN", raising=False)
    config = yaml.safe_load((REPO / "deploy/laneway.example.yaml").read_text())
    with running_proxy(config) as proxy:
        listing = admin(proxy.url, "GET", "backends", headers={})
        reload = admin(proxy.url, "POST", "reload", headers={})
    assert listing.status_code == 404 and reload.status_code == 404


def test_the_compose_stack_takes_the_admin_token_from_the_operator_only() -> None:
    environment = compose("docker-compose.yml")["x-laneway"]["environment"]
    assert environment["LANEWAY_ADMIN__TOKEN"] == "${LANEWAY_ADMIN_TOKEN:-}"  # no default
    for name in ("laneway.yaml", "laneway.cpu.yaml"):
        section = yaml.safe_load((REPO / "deploy/compose" / name).read_text()).get("admin")
        assert not (section or {}).get("token"), name  # no token in a file in git
        assert (section or {}).get("enabled") is not True, name  # on only with the token


def test_the_balancer_does_not_publish_the_admin_api() -> None:
    nginx = (REPO / "deploy/compose/nginx.conf").read_text()
    assert "location /admin/ { return 404; }" in nginx
