"""The configuration reference, generated from the pydantic models in `proxy/config.py`.

An MkDocs hook (`mkdocs.yml`, `hooks:`): a page's `<!-- config-reference -->` becomes a
table per section of the config tree (field, type, default, description), and
`<!-- policy-params: NAME -->` the table of policy NAME's `Params`. Generated at build
time from the models themselves, so the pages cannot drift from the code.
`python docs/gen_config_reference.py` prints the config reference.
"""

from __future__ import annotations

import html
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # mkdocs loads a hook by path; the code is beside it
    sys.path.insert(0, str(REPO))

CONFIG_MARKER = "<!-- config-reference -->"
PARAMS_MARKER = "<!-- policy-params: "


def type_name(tp: Any) -> str:
    """A readable name for an annotation: `int`, `list[str]`, `'text' | 'json'`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def nested_model(tp: Any) -> tuple[type[BaseModel], str] | None:
    """The section model a field holds, and the suffix of its path (`[]` for a list)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp, ""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], "[]"
    if origin is dict and len(args) == 2 and isinstance(args[1], type) \
            and issubclass(args[1], BaseModel):  # name -> section (slo_classes)
        return args[1], ""
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            found = nested_model(arg)
            if found:
                return found
    return None


def _constraints(info: FieldInfo) -> str:
    signs = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤", "min_length": "min length"}
    parts = [f"{signs[k]} {getattr(m, k)}" for m in info.metadata for k in signs if hasattr(m, k)]
    return f" ({', '.join(parts)})" if parts else ""


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.default_factory() if info.default_factory else info.default  # type: ignore[call-arg]
    if isinstance(value, BaseModel):
        return "(section)"
    return code(repr(value))


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def code(text: str) -> str:
    """A code cell that may hold `|`: Markdown tables split on it even inside backticks,
    and an escaped one shows its backslash there, so the cell is HTML."""
    return "<code>" + html.escape(" ".join(text.split())).replace("|", "&#124;") + "</code>"


def field_rows(model: type[BaseModel]) -> list[tuple[str, str, str, str]]:
    """(field, type, default, description) of each field of one model."""
    return [(name, code(type_name(info.annotation) + _constraints(info)), _default(info),
             _cell(info.description or ""))
            for name, info in model.model_fields.items()]


def sections(model: type[BaseModel], path: str = "") -> list[tuple[str, type[BaseModel]]]:
    """Every section of the tree under `model`, depth first, with its dotted path."""
    found = [(path or "(top level)", model)]
    for name, info in model.model_fields.items():
        nested = nested_model(info.annotation)
        if nested:
            found += sections(nested[0], f"{path}.{name}{nested[1]}".lstrip("."))
    return found


def table(model: type[BaseModel]) -> str:
    lines = ["| field | type | default | description |", "|---|---|---|---|"]
    lines += [f"| `{n}` | {t} | {d} | {desc} |" for n, t, d, desc in field_rows(model)]
    return "\n".join(lines)


def config_reference() -> str:
    from proxy.config import Settings

    out = []
    for path, model in sections(Settings):
        doc = (model.__doc__ or "").strip() if path != "(top level)" else ""
        out += [f"## `{path}`", ""] + ([doc, ""] if doc else []) + [table(model), ""]
    return "\n".join(out)


def policy_params(name: str) -> str:
    from policies import POLICIES

    params: type[BaseModel] = POLICIES[name].Params
    if not params.model_fields:
        return "This policy takes no params."
    return table(params)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs hook: fill the markers of a page."""
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_reference())
    while PARAMS_MARKER in markdown:
        start = markdown.index(PARAMS_MARKER)
        end = markdown.index("-->", start)
        name = markdown[start + len(PARAMS_MARKER):end].strip()
        markdown = markdown[:start] + policy_params(name) + markdown[end + 3:]
    return markdown


if __name__ == "__main__":
    print(config_reference())
