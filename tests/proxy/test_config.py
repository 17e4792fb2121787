from pathlib import Path

import pytest

from proxy.config import ConfigError, load_settings

GOOD = """
server: {host: 0.0.0.0, port: 9000}
backends:
  - {name: a, url: "http://10.0.0.1:8000", model: llama, labels: {gpu: a100}}
  - {name: b, url: "http://10.0.0.2:8000/", model: llama}
policy: {name: least_request, params: {}}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "laneway.yaml"
    path.write_text(text)
    return path


def test_loads_documented_shape(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, GOOD))
    assert settings.server.port == 9000
    assert [b.name for b in settings.backends] == ["a", "b"]
    assert settings.backends[0].labels == {"gpu": "a100"}
    assert settings.policy.name == "least_request"


def test_env_overrides_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANEWAY_SERVER__PORT", "9100")
    monkeypatch.setenv("LANEWAY_POLICY__NAME", "round_robin")
    settings = load_settings(write(tmp_path, GOOD))
    assert settings.server.port == 9100
    assert settings.policy.name == "round_robin"
    assert settings.server.host == "0.0.0.0"  # untouched keys keep the YAML value


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("server: {port: 9000, prot: 1}", "server.prot"),
        ("server: {port: -1}", "server.port"),
        ("backends: [{name: a, url: 'not a url', model: m}]", "backends.0.url"),
        ("backends: [{name: a, url: 'http://x:1', model: m, colour: red}]", "backends.0.colour"),
        ("backends: [{name: a, url: 'http://x:1'}]", "backends.0.model"),
        ("polcy: {name: random}", "polcy"),
        ("policy: {name: nope}", "policy.name"),
        ("policy: {name: round_robin, params: {bogus: 1}}", "policy.params.bogus"),
        ("policy: {name: eldr, params: {artifact: x, kv_transfer: true}}",
         "policy.params.kv_transfer: Value error, needs pd: true"),
        ("upstream: {max_attempts: 0}", "upstream.max_attempts"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, text))
    assert key in str(info.value)


def test_duplicate_backend_names_rejected(tmp_path: Path) -> None:
    text = ("backends: [{name: a, url: 'http://x:1', model: m},"
            " {name: a, url: 'http://y:1', model: m}]")
    with pytest.raises(ConfigError, match="duplicate backend names: a"):
        load_settings(write(tmp_path, text))


def test_unreadable_and_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        load_settings(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(write(tmp_path, "server: {port: [1,\n"))


def test_example_config_documents_every_option() -> None:
    """deploy/laneway.example.yaml loads and names every option of every section."""
    import yaml
    from pydantic import BaseModel

    from proxy.config import Settings

    example = Path(__file__).resolve().parents[2] / "deploy" / "laneway.example.yaml"
    load_settings(example)
    written = yaml.safe_load(example.read_text())
    for section, info in Settings.model_fields.items():
        assert section in written, f"section {section} undocumented"
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            missing = set(annotation.model_fields) - set(written[section])
            assert not missing, f"{section}: undocumented options {sorted(missing)}"



@pytest.mark.parametrize(("groups", "message"), [
    ("{team: []}", "names no model"),
    ("{llama: [llama]}", "also a served model name"),
    ("{team: [llama], all: [team, llama]}", "lists groups: team"),
])
def test_bad_model_groups_are_rejected(tmp_path: Path, groups: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(write(tmp_path, GOOD + f"model_groups: {groups}\n"))


def test_a_model_group_loads(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, GOOD + "model_groups: {any: [llama, qwen]}\n"))
    assert settings.model_groups == {"any": ["llama", "qwen"]}


def test_a_policy_whose_files_do_not_load_is_a_config_error(tmp_path: Path) -> None:
    """Valid params, but the checkpoint is missing or is not a checkpoint: the proxy
    says which key and why at start (and check-config), not with a traceback."""
    missing = tmp_path / "none" / "best.pt"
    text = f"policy: {{name: qos_drl, params: {{checkpoint: '{missing}'}}}}"
    with pytest.raises(ConfigError, match=r"policy\.params: policy qos_drl cannot start: "
                       r".*No such file") as info:
        load_settings(write(tmp_path, text))
    assert str(missing) in str(info.value)
    garbage = tmp_path / "garbage.pt"
    garbage.write_text("not a checkpoint")
    with pytest.raises(ConfigError, match=r"policy\.params: policy qos_drl cannot start"):
        load_settings(write(tmp_path, f"policy: {{name: qos_drl, params: "
                                      f"{{checkpoint: '{garbage}'}}}}"))


def test_the_length_artifact_is_checked_at_load(tmp_path: Path) -> None:
    artifact = tmp_path / "length"
    text = f"predictors: {{length: {{artifact: '{artifact}'}}}}"
    with pytest.raises(ConfigError, match=r"predictors\.length\.artifact: cannot read "
                       r".*meta\.json: No such file.*laneway train length"):
        load_settings(write(tmp_path, text))
    artifact.mkdir()
    (artifact / "meta.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        load_settings(write(tmp_path, text))
    (artifact / "meta.json").write_text('{"format": 1, "kind": "buckets"}')
    with pytest.raises(ConfigError, match="not a length_moe artifact of format 1"):
        load_settings(write(tmp_path, text))
    (artifact / "meta.json").write_text('{"format": 1, "kind": "length_moe"}')
    settings = load_settings(write(tmp_path, text))  # the weights load at start
    assert settings.predictors.length.artifact == str(artifact)


def test_serve_routes_with_the_policy_its_config_check_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A policy with models (qos_drl: ~0.4 s) is built once at start, not twice."""
    import asyncio

    from policies import base
    from proxy import cli
    from proxy.http import server
    from proxy.runtime import Runtime

    builds: list[object] = []

    def counting(name: str, params: dict[str, object] | None = None) -> base.Policy:
        builds.append(policy := real(name, params))
        return policy

    real = base.build_policy
    monkeypatch.setattr(base, "build_policy", counting)
    monkeypatch.setattr("proxy.runtime.build_policy", counting)
    routed: list[object] = []

    def fake_run(settings: object, config_path: str | None, policy: base.Policy) -> None:
        app = server.LanewayApp(settings, config_path, policy)  # type: ignore[arg-type]

        async def start() -> None:  # what the lifespan builds
            rt = Runtime(app.settings, app.config_path, app.policy)
            routed.append(rt.router.policy)
            await rt.close()
        asyncio.run(start())

    monkeypatch.setattr(server, "run", fake_run)
    assert cli.main(["serve", "--config", str(write(tmp_path, GOOD)), "--port", "0"]) == 0
    assert len(builds) == 1 and routed == builds


def _disco(sides: list[str | None], params: str = "{}") -> str:
    backends = ", ".join(
        f"{{name: b{i}, url: 'http://x:{i + 1}', model: m"
        + ("" if side is None else f", labels: {{side: {side}}}") + "}"
        for i, side in enumerate(sides))
    return f"backends: [{backends}]\npolicy: {{name: disco, params: {params}}}\n"


@pytest.mark.parametrize(("sides", "params", "missing"), [
    (["server", "server"], "{}", "`side: device`"),
    (["device", None], "{}", "`side: server`"),  # unlabelled is not labelled
    ([None], "{}", "`side: device` or `side: server`"),
    (["server"], "{strategy: device_only}", "`side: device`"),
])
def test_disco_needs_a_backend_on_each_side(tmp_path: Path, sides: list[str | None],
                                             params: str, missing: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, _disco(sides, params)))
    message = str(info.value)
    assert "backends[].labels.side" in message and f"none is labelled {missing}" in message


def test_disco_refuses_an_unknown_side(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"backends\[1\]\.labels\.side: 'edge'"):
        load_settings(write(tmp_path, _disco(["server", "edge", "device"])))


def test_disco_with_both_sides_is_ok(tmp_path: Path) -> None:
    assert load_settings(write(tmp_path, _disco(["device", "server", None]))).policy.name \
        == "disco"
    assert load_settings(write(tmp_path, _disco(["server"], "{strategy: server_only}")))
