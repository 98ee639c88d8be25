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
    from calm_runtime.cli.main import build_parser as calm_parser

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
    from conftest import FAMILIES

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


def test_index_maps_every_page():
    """docs/index.md links every page of docs/ (a page no map names is a page nobody finds)."""
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert pages and all(f"]({page})" in index for page in pages), sorted(
        page for page in pages if f"]({page})" not in index)


@pytest.mark.parametrize("page", ["guide.md", "tutorial.md"])
def test_python_blocks_of_the_guides_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = ROOT / "docs" / page
    for block in re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
        exec(compile(block, str(path), "exec"), {"__name__": "__docs__"})


def _shell_commands(path: Path) -> list[list[str]]:
    """The ``calm`` / ``calm-export`` command lines of a page's bash blocks, as argv."""
    import shlex

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith(("calm ", "calm-export ")):
                commands.append(shlex.split(line.replace("$'", "'")))
    return commands


def test_tutorial_commands_parse_and_take_limit():
    """Every command of the tutorial is a valid command line, and every one that scores
    questions (has --data) runs with --limit, so the whole sitting can be tried small."""
    pytest.importorskip("torch")
    pytest.importorskip("onnx")
    from calm_export.cli import build_parser as export_parser
    from calm_runtime.cli.main import build_parser as calm_parser

    commands = _shell_commands(ROOT / "docs" / "tutorial.md")
    assert {c[1] for c in commands if c[0] == "calm"} >= {"eval", "fit", "score", "serve",
                                                          "generate"}
    for argv in commands:
        parser = export_parser() if argv[0] == "calm-export" else calm_parser()
        parser.parse_args(argv[1:])  # exits (SystemExit) on an unknown option
        if "--data" in argv:
            assert "--limit" in argv, argv


def test_help_states_no_measured_numbers():
    """--help says what an option does and points to the docs; intervals, ratios and
    measured metrics belong in docs/results.md, where a test holds them to the result files."""
    pytest.importorskip("torch")
    pytest.importorskip("onnx")
    from calm_export.cli import build_parser as export_parser
    from calm_runtime.cli.main import build_parser as calm_parser

    measured = re.compile(r"\[\s*[-+−]?\d*\.\d+\s*,\s*[-+−]?\d*\.\d+\s*\]"  # an interval
                          r"|±|\b\d+(?:\.\d+)?x (?:faster|slower|the)\b"     # a speed ratio
                          r"|\b(?:ECE|accuracy|AUROC|NLL) (?:of )?[-+]?\d*\.\d+")
    found = []
    for prefix, parser in [*_commands(calm_parser(), "calm"),
                           *_commands(export_parser(), "calm-export")]:
        found += [f"{prefix}: {m.group(0)}" for m in measured.finditer(parser.format_help())]
    assert not found, found


def test_calm_block_lands_in_docs_results():
    """calm_decisive.py --report writes its block between the markers that docs/results.md
    holds (README.md no longer has them)."""
    pytest.importorskip("torch")
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _decisive_report as decisive_report
        import calm_decisive
        import render_results
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    start, end = decisive_report.README_START, decisive_report.README_END
    assert (start, end) == (render_results.CALM_START, render_results.CALM_END)
    assert Path(calm_decisive.parse_args([]).readme) == ROOT / "docs" / "results.md"
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert start in results and end in results
    assert start not in (ROOT / "README.md").read_text(encoding="utf-8")
