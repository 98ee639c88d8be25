"""The project's documentation: every cited page exists, and the CLI reference is complete."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "README.md", ROOT / "pyproject.toml",
           *[p for folder in ("calm_runtime", "export", "training", "tests", "benchmarks", "docs")
             for p in sorted((ROOT / folder).rglob("*")) if p.suffix in (".py", ".md")
             and "results" not in p.relative_to(ROOT).parts]]
# a path-like name ending in .md, optionally followed by a section sign and number
CITATION = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.md)\b(?:\s*§\s*(\d+))?")
HEADING = re.compile(r"^#+ §(\d+)\b", re.M)


def _citations():
    for source in SOURCES:
        text = source.read_text(encoding="utf-8")
        for match in CITATION.finditer(text):
            yield source, match.group(1), match.group(2)


def _resolve(source: Path, name: str) -> Path | None:
    for base in (ROOT, source.parent, ROOT / "docs", ROOT / "benchmarks" / "results"):
        if (base / name).is_file():
            return base / name
    return None


def test_the_scan_finds_the_citations():  # the test below must not pass by finding nothing
    names = {name for _, name, _ in _citations()}
    assert {"docs/methods.md", "docs/formats.md", "docs/data.md", "docs/cli.md"} <= names


def test_every_cited_markdown_file_exists_with_its_section():
    missing, sections = [], []
    for source, name, section in _citations():
        path = _resolve(source, name)
        where = f"{source.relative_to(ROOT)}: {name}"
        placeholder = any(re.fullmatch(r"[A-Z_]{2,}", part) for part in
                          re.split(r"[/.]", name)[:-1])  # OUT/calibration.md, results/NAME.md
        if path is None and not placeholder:
            missing.append(where)
        elif path is not None and section:
            if section not in HEADING.findall(path.read_text(encoding="utf-8")):
                sections.append(f"{where} §{section}")
    assert not missing, f"cited but not in the repository: {missing}"
    assert not sections, f"cited sections with no heading '§N' in the page: {sections}"


def _commands(parser: argparse.ArgumentParser, prefix: str):
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, f"{prefix} {name}")


def test_cli_reference_lists_every_command_and_option():
    pytest.importorskip("torch")  # with the train and export extras, no command is a stand-in
    pytest.importorskip("onnx")
    from calm_export.cli import build_parser as export_parser
    from calm_runtime.cli import build_parser as calm_parser

    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    blocks = dict(re.findall(r"^#+ `([^`]+)`\n\n```text\n(.*?)\n```", text, re.S | re.M))
    stale = []
    for prefix, parser in [*_commands(calm_parser(), "calm"),
                           *_commands(export_parser(), "calm-export")]:
        block = blocks.get(prefix)
        if block is None:
            stale.append(f"{prefix}: no section")
            continue
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:
                continue
            for option in action.option_strings:
                if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", block):
                    stale.append(f"{prefix}: {option}")
    assert not stale, f"docs/cli.md is stale ({stale}); run python docs/render_cli.py"


def test_architecture_table_is_generated_from_the_conformance_matrix():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_families",
                                                  ROOT / "docs" / "render_families.py")
    renderer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(renderer)
    text = (ROOT / "docs" / "architectures.md").read_text(encoding="utf-8")
    assert renderer.render() in text, ("docs/architectures.md is stale; run python "
                                       "docs/render_families.py")
    from calm_export.families import FAMILIES

    assert len(FAMILIES) >= 10 and all(f"| {f.name} |" in text for f in FAMILIES)


def test_formats_lists_every_fit_setting():
    """docs/formats.md's ``method.settings`` row names every field of ``FitConfig`` (what
    ``calm fit`` writes there)."""
    dataclasses = pytest.importorskip("dataclasses")
    fit = pytest.importorskip("calm_training.fit")
    row = next(line for line in (ROOT / "docs" / "formats.md").read_text().splitlines()
               if line.startswith("| `method.settings` | all the fit settings"))
    listed = set(re.findall(r"`(\w+)`", row.split("|")[2]))
    assert {f.name for f in dataclasses.fields(fit.FitConfig)} <= listed
