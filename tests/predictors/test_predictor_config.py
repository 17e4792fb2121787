from pathlib import Path

import pytest

from proxy.config import ConfigError, LengthPredictorConfig, Settings, load_settings

YAML = """
predictors:
  length:
    artifact: {artifact}
    model_map: {tiny-llama: gpt-3.5-turbo-1106}
    fallback_key: null
"""


def test_defaults_keep_predictions_off() -> None:
    length = Settings().predictors.length
    assert length.artifact is None and length.model_map == {} and length.fallback_key == "any"


def artifact_dir(root: Path) -> Path:
    """A directory that passes the config's check of a length artifact (its meta.json)."""
    root.mkdir()
    (root / "meta.json").write_text('{"format": 1, "kind": "length_moe"}')
    return root


def test_yaml_section_loads(tmp_path: Path) -> None:
    path = tmp_path / "laneway.yaml"
    artifact = artifact_dir(tmp_path / "length-moe-v1")
    path.write_text(YAML.replace("{artifact}", str(artifact)))
    length = load_settings(path).predictors.length
    assert length.artifact == str(artifact)
    assert length.model_map == {"tiny-llama": "gpt-3.5-turbo-1106"}
    assert length.fallback_key is None


def test_env_overrides_artifact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = artifact_dir(tmp_path / "elsewhere")
    monkeypatch.setenv("LANEWAY_PREDICTORS__LENGTH__ARTIFACT", str(elsewhere))
    assert load_settings().predictors.length.artifact == str(elsewhere)


def test_unknown_key_names_its_path(tmp_path: Path) -> None:
    path = tmp_path / "laneway.yaml"
    path.write_text("predictors: {length: {artefact: x}}\n")
    with pytest.raises(ConfigError, match=r"predictors\.length\.artefact"):
        load_settings(path)


def test_example_documents_every_predictor_option() -> None:
    import yaml

    example = Path(__file__).resolve().parents[2] / "deploy" / "laneway.example.yaml"
    written = yaml.safe_load(example.read_text())["predictors"]["length"]
    assert set(written) == set(LengthPredictorConfig.model_fields)
    assert written["artifact"] is None  # the example keeps today's behaviour


def test_cli_registers_train_length_without_importing_torch() -> None:
    """`laneway serve` builds the same parser: it must not pay for (or need) torch."""
    import subprocess
    import sys

    code = ("import sys, proxy.cli as c; p = c.build_parser(); "
            "a = p.parse_args(['train', 'length', '--epochs', '3']); "
            "print(a.epochs, 'torch' in sys.modules, 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.split() == ["3", "False", "False"]


@pytest.mark.parametrize(("command", "trainer"), [("length", "laneway train length"),
                                                   ("buckets", "laneway train buckets")])
def test_evaluating_without_an_artifact_says_how_to_make_one(
        tmp_path: Path, command: str, trainer: str) -> None:
    from proxy.cli import main

    with pytest.raises(SystemExit, match=f"no predictor artifact at {tmp_path}.*{trainer}"):
        main(["evaluate", command, "--artifact", str(tmp_path), "--out",
              str(tmp_path / "out.json")])


def test_a_missing_input_file_is_one_line_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.cli import main

    missing = tmp_path / "none.jsonl"
    assert main(["train", "length", "--data", str(missing), "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"laneway: [Errno 2] No such file or directory: " \
                                      f"'{missing}'\n"
