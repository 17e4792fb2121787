"""What a user's `pip install laneway` gets: the product only, and a proxy that runs
without the heavy extras (torch, vLLM, transformers, scikit-learn)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

from predictors.home import REPO

PRODUCT = {"proxy", "policies", "predictors"}
HEAVY = ("torch", "vllm", "transformers", "tokenizers", "sklearn", "onnxruntime")


def test_the_wheel_holds_the_product_and_nothing_else(tmp_path: Path) -> None:
    # built from a copy of the sources (setuptools writes build/ beside them)
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "proxy", "policies", "predictors"):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, source / name)
    for name in ("datasets/data", "datasets/traces"):
        (source / name).mkdir(parents=True)
        for license_file in (REPO / name).glob("LICENSE-*"):
            shutil.copy(license_file, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(source)],
                   check=True, capture_output=True)
    [wheel] = tmp_path.glob("laneway-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/", 1)[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == PRODUCT
    assert not any(name.startswith(("bench/", "tests/")) for name in names)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "License-Expression: Apache-2.0" in text
    requires = [line for line in text.splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert not any(heavy in line for line in requires for heavy in HEAVY), requires


def test_the_proxy_serves_without_the_heavy_extras(tmp_path: Path) -> None:
    """Every policy registers and a config checks with torch & co. unimportable."""
    config = tmp_path / "laneway.yaml"
    config.write_text("backends: [{name: a, url: 'http://127.0.0.1:9', model: m}]\n"
                      "policy: {name: goodput}\n")
    code = textwrap.dedent(f"""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {HEAVY!r}:
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import policies, proxy.http.app, proxy.cli
        assert len(policies.POLICIES) >= 11, policies.POLICIES
        sys.exit(proxy.cli.main(["check-config", "--config", {str(config)!r}]))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin"})
    assert done.returncode == 0, done.stderr
    assert "config ok" in done.stdout
