"""Second review of #71: what the compose files publish is not open by default.
Grafana (published on :3000) gets no default admin password (it was admin/admin), and
a GPU node's vLLMs (published on the node's ports) do not start without an API key
(without one, anyone who reaches the node uses the GPUs around laneway's keys)."""

from __future__ import annotations

from tests.deploy.test_deploy_files import compose


def test_grafana_has_no_default_admin_password() -> None:
    grafana = compose("docker-compose.yml")["services"]["grafana"]
    password = grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert password.startswith("${GRAFANA_ADMIN_PASSWORD:?"), password  # required


def test_a_gpu_nodes_published_vllms_need_a_key() -> None:
    for name, service in compose("deploy/compose/gpu-node.yml")["services"].items():
        assert service.get("ports"), name  # (why a key is needed)
        key = service["environment"]["VLLM_API_KEY"]
        assert key.startswith("${VLLM_API_KEY:?"), (name, key)  # required
