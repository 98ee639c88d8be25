"""Help that tells the truth: every example in every ``--help`` and in the README and docs
parses with the real parsers, copied as one line; every option's default is shown; ``-q``
and ``-v`` are the same on ``calm`` and ``calm-export``; ``--model`` names the same forms
everywhere."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from calm_runtime.cli.common import HelpFormatter
from calm_runtime.cli.main import build_parser
from calm_runtime.data.models import MODEL_FORMS

pytest.importorskip("calm_export")
from calm_export.cli import build_parser as export_parser  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _parsers(parser, name):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from _parsers(child, f"{name} {sub}")


ALL = [*_parsers(build_parser(), "calm"), *_parsers(export_parser(), "calm-export")]
COMMANDS = sorted({name.split()[1] for name, _ in ALL if name.count(" ") == 1
                   and name.startswith("calm ")})


def _commands(text: str) -> list[str]:
    """``calm ...`` / ``calm-export ...`` command lines in ``text``, continuation lines
    joined, comments dropped."""
    lines, out, current = text.splitlines(), [], None
    for raw in lines:
        line = raw.strip()
        if current is not None:
            current += " " + line.rstrip("\\").strip()
            if not line.endswith("\\"):
                out.append(current)
                current = None
            continue
        if re.match(rf"^(\$ )?(calm ({'|'.join(COMMANDS)})\b|calm-export --)", line):
            line = line.removeprefix("$ ")
            if line.endswith("\\"):
                current = line.rstrip("\\").strip()
            else:
                out.append(line)
    return [re.sub(r"\s+#.*$", "", c) for c in out]


def _parse(command: str) -> None:
    words = shlex.split(command.replace("...", "X"))
    words = [w for w in words if w != "|"]
    if "|" in command or ">" in words:
        words = words[:words.index(">")] if ">" in words else words
    parser = export_parser() if words[0] == "calm-export" else build_parser()
    parser.parse_args(words[1:])


@pytest.mark.parametrize("name, parser", ALL, ids=[n for n, _ in ALL])
def test_every_help_example_is_one_copyable_command(name, parser, monkeypatch):
    text = parser.format_help()
    for command in _commands(text.split("examples:", 1)[-1] if "examples:" in text else ""):
        assert "\n" not in command
        _parse(command)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_documented_command_parses(page):
    blocks = re.findall(r"```(?:bash|sh|console|text)?\n(.*?)```", page.read_text(), flags=re.S)
    commands = [c for b in blocks for c in _commands(b)]
    for command in commands:
        if any(mark in command for mark in ("<", "NAME", "PATH", "$")):
            continue  # a placeholder, not a command to copy
        try:
            _parse(command)
        except SystemExit as exc:  # argparse's refusal
            raise AssertionError(f"{page.name}: `{command}` does not parse") from exc


@pytest.mark.parametrize("name, parser", ALL, ids=[n for n, _ in ALL])
def test_every_default_is_shown(name, parser):
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if not HelpFormatter.shows_default(action) or action.help == argparse.SUPPRESS:
            continue
        value = action.default
        shown = {str(value)} | ({str(int(value))} if isinstance(value, float)
                                and value.is_integer() else set())
        assert any(v in text for v in shown), (name, action.option_strings, shown)
    assert parser.formatter_class is HelpFormatter, name


def test_quiet_and_verbose_on_both_commands():
    for parser in (build_parser(), export_parser()):
        for flag in ("-q", "--quiet", "-v", "--verbose"):
            assert flag in parser._option_string_actions, (parser.prog, flag)
    args = export_parser().parse_args(["--model", "m", "--out", "o", "-q", "-v"])
    assert args.quiet and args.verbose


def test_model_help_names_the_same_forms_everywhere():
    seen = 0
    for name, parser in ALL:
        action = parser._option_string_actions.get("--model")
        if action is None or name in ("calm score", "calm serve"):
            continue
        assert MODEL_FORMS in action.help, (name, action.help)
        seen += 1
    assert seen >= 5  # fit, eval, train, export (both), generate
    assert "hub id" in MODEL_FORMS


def test_bench_offers_every_benchmark_of_the_folder():
    from calm_runtime.cli.main import benchmark_names

    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")
               if not p.stem.startswith("_")} - {"render_results"}
    assert set(benchmark_names()) == scripts and "calm_decisive" in scripts


def test_server_doc_names_every_request_field_and_no_served_schema():
    pytest.importorskip("fastapi")
    from calm_runtime.server.app import create_app  # noqa: F401 - the app the page describes
    from calm_runtime.server.protocol import CalmOptions

    page = (ROOT / "docs" / "server.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `calm` |"))
    for field in CalmOptions.model_fields:
        assert f'"{field}"' in row, field
    # the app serves no schema: the page must not send a reader to a URL for it
    assert "publishes no\n`/docs` or `/openapi.json`" in page or "no `/openapi.json`" in page \
        or "/docs` or `/openapi.json`" in page
    assert "(`/openapi.json`)" not in page
    assert "--api-key KEY" in page  # the flag the page once said did not exist


def test_docs_name_no_folder_of_the_machine_that_made_them():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _common import MACHINE_PATH, portable
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert portable("--llama-cpp /work/lcb/llama.cpp/build --out /tmp/x") == \
        "--llama-cpp build --out x"
    results = sorted(p for p in (ROOT / "benchmarks" / "results").rglob("*")
                     if p.suffix in (".json", ".md"))
    assert results  # the result files are scanned too, parts included
    for page in [*PAGES, *results]:
        found = MACHINE_PATH.findall(page.read_text())
        assert not found, (str(page.relative_to(ROOT)), found[:3])


@pytest.mark.parametrize("method", ["daca", "naive", "daca-vector", "ts", "ts-vector",
                                    "threshold"])
def test_calm_fit_method_help_lists_only_what_the_method_uses(method, capsys):
    """`calm fit METHOD --help`: the reference's options only for label-free methods, the
    abstention flags only for threshold, the token-level fit's only where there is one, the
    P(True) template only where P(True) is fitted; no old option names."""
    pytest.importorskip("torch")
    from calm_runtime.cli.main import main
    from calm_training.methods import fit_method

    with pytest.raises(SystemExit):
        main(["fit", method, "--help"])
    text = capsys.readouterr().out
    from calm_training.methods import ADAPTER_METHODS

    assert set(ADAPTER_METHODS) == {"daca", "naive", "daca-vector", "ts", "ts-vector",
                                    "threshold"}
    m = fit_method(method)
    assert ("--reference " in text) == m.needs_reference
    assert ("--reference-scores" in text) == m.needs_reference
    assert ("--risk" in text) == m.abstention
    assert ("--no-token-fit" in text) == m.token_level
    assert ("--template" in text) == m.p_true
    assert "--split" not in text
