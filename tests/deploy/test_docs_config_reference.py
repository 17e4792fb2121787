"""The configuration reference page (docs/gen_config_reference.py, an MkDocs hook) has a
row for every field of the config tree, under its section's dotted path, with the
field's real default; and every policy's params table has every field of its `Params`."""

from __future__ import annotations

import html
import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from pydantic import BaseModel

from policies import POLICIES
from proxy.config import (
    ApiKeyConfig,
    BackendConfig,
    LengthPredictorConfig,
    ServerConfig,
    Settings,
)

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `([^`]+)` \| (.*?) \| (.*?) \| (.*) \|$")


def text_of(cell: str) -> str:
    """What a reader sees in a generated code cell (`<code>…</code>`)."""
    return html.unescape(cell.removeprefix("<code>").removesuffix("</code>"))


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_reference",
                                                  REPO / "docs" / "gen_config_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documented(markdown: str) -> dict[str, tuple[str, str, str]]:
    """dotted path -> (type, default, description) of each row, read back from the page."""
    rows: dict[str, tuple[str, str, str]] = {}
    section = ""
    for line in markdown.splitlines():
        if line.startswith("## `"):
            section = line[4:-1]
            section = "" if section == "(top level)" else section
        elif match := ROW.match(line):
            path = f"{section}.{match.group(1)}".lstrip(".")
            assert path not in rows, f"documented twice: {path}"
            rows[path] = (text_of(match.group(2)), text_of(match.group(3)), match.group(4))
    return rows


def every_field(model: type[BaseModel], path: str = "") -> set[str]:
    """Walk the config tree independently of the generator: each field's dotted path,
    `[]` after a list of sections."""
    paths = set()
    for name, info in model.model_fields.items():
        dotted = f"{path}.{name}".lstrip(".")
        paths.add(dotted)
        annotation: Any = info.annotation
        args = getattr(annotation, "__args__", ())
        for candidate in (annotation, *args):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                suffix = "[]" if args and candidate in args and "list" in str(annotation) else ""
                paths |= every_field(candidate, dotted + suffix)
    return paths


def test_the_reference_has_a_row_for_every_field_of_the_config_tree() -> None:
    rows = documented(generator().config_reference())
    fields = every_field(Settings)
    assert len(fields) > 100  # the walk went into the sections
    assert fields - set(rows) == set()
    assert set(rows) - fields == set()


def test_rows_carry_the_models_defaults_types_and_descriptions() -> None:
    rows = documented(generator().config_reference())
    assert rows["server.port"][1] == repr(ServerConfig().port)
    assert "≤ 65535" in rows["server.port"][0]
    assert rows["backends[].url"][1] == "required"
    assert rows["backends[].model"][2] == BackendConfig.model_fields["model"].description
    assert rows["auth.keys[].name"][1] == "required"
    assert rows["auth.keys[].priority"][1] == repr(ApiKeyConfig.model_fields["priority"].default)
    assert rows["predictors.length.fallback_key"][1] == repr(LengthPredictorConfig().fallback_key)
    assert rows["server.log_format"][0] == "'text' | 'json'"


def test_the_hook_fills_the_page_markers() -> None:
    hook = generator().on_page_markdown
    page = "# Config\n\n<!-- config-reference -->\n\n<!-- policy-params: goodput -->\n"
    filled = hook(page, page=None, config=None, files=None)
    assert "<!--" not in filled
    assert "## `flow_control`" in filled and "| `length_quantile` |" in filled


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_each_policys_params_table_lists_every_param(name: str) -> None:
    text = generator().policy_params(name)
    params = POLICIES[name].Params.model_fields
    assert {m.group(1) for line in text.splitlines() if (m := ROW.match(line))} == set(params)
    if not params:
        assert text == "This policy takes no params."
