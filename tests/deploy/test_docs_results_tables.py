"""The benchmark tables of the docs site (docs/gen_results_tables.py, an MkDocs hook) are
read from the latest result files: every marker on a page renders, and the figures in a
table are the file's."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"
PAGES = sorted(p for p in (REPO / "docs").rglob("*.md") if RESULTS not in p.parents)
MARKER = re.compile(r"<!-- results-table: (.*?) -->")


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_results_tables",
                                                  REPO / "docs" / "gen_results_tables.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def markers() -> list[str]:
    return [m for page in PAGES for m in MARKER.findall(page.read_text())]


def test_the_pages_use_the_generated_tables() -> None:
    kinds = {m.split()[0] for m in markers()}
    assert {"overhead", "peers", "policy-latency", "policies", "policy", "goodput-headline",
            "files"} <= kinds


@pytest.mark.parametrize("spec", sorted(set(markers())))
def test_every_marker_renders_a_table(spec: str) -> None:
    page = f"before\n\n<!-- results-table: {spec} -->\n\nafter\n"
    filled = generator().on_page_markdown(page, page=None, config=None, files=None)
    assert "<!--" not in filled
    assert re.search(r"^\|---\|", filled, re.M)


def test_the_figures_are_the_files() -> None:
    gen = generator()
    overhead = json.loads((RESULTS / "overhead.json").read_text())
    assert f"+{overhead['non_stream']['added_p50_ms']:.2f} ms" in gen.render("overhead")
    goodput = json.loads((RESULTS / "goodput.json").read_text())
    ratio = goodput["goodput_ratio_vs_best_baseline"]["1.5"]
    assert f"{ratio:.2f}" in gen.render("goodput-headline")
    latency = json.loads((RESULTS / "policy_latency.json").read_text())
    session = next(d for d in latency if d["policy"] == "session" and d["backends"] == 512)
    assert f"{session['p99_us']:.1f} µs" in gen.render("policy session")


def test_the_files_table_lists_every_top_level_result() -> None:
    listed = set(re.findall(r"^\| `([^`]+\.json)` \|", generator().render("files"), re.M))
    assert listed == {p.name for p in RESULTS.glob("*.json")}
