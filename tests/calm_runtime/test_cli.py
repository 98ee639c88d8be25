"""The ``calm`` command: help with examples, one-line errors, exit codes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from calm_runtime.cli import main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "calm_runtime.cli", *args],
                          capture_output=True, text=True, check=False)


def test_help_shows_examples():
    result = _run("--help")
    assert result.returncode == 0
    assert "examples:" in result.stdout and "calm quickstart" in result.stdout


@pytest.mark.parametrize("sub", ["models", "data", "fit", "eval", "quickstart"])
def test_every_subcommand_has_help(sub, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([sub, "--help"])
    assert exit_info.value.code == 0
    assert "example" in capsys.readouterr().out


def test_calm_error_is_one_line_without_traceback(tmp_path):
    result = _run("models", "install", "no-such-model")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ModelSourceError: unknown packaged model")
    assert "Traceback" not in result.stderr


def test_data_check_reports_the_bad_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "choices": ["a", "b"], "answer": 0}\n{"question": 1}\n')
    result = _run("data", "check", str(bad))
    assert result.returncode == 1
    assert f"{bad}:2:" in result.stderr and "Traceback" not in result.stderr


def test_eval_without_target_is_a_clear_error(capsys):
    assert main(["eval", "--model", "x", "--data", "y"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ConfigError: nothing to evaluate"), err
