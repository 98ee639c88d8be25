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


@pytest.mark.parametrize("sub", ["models", "data", "fit", "eval", "quickstart", "train",
                                 "generate", "score", "serve", "bench", "export"])
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


def test_bench_runs_the_checkout_script():
    result = _run("bench", "latency", "--help")
    assert result.returncode == 0
    assert "--identity-engine" in result.stdout


def test_bench_outside_a_checkout_is_a_clear_error(tmp_path, monkeypatch):
    import calm_runtime.cli as cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site" / "calm_runtime" / "cli.py"))
    from calm_runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="benchmarks/latency.py not found"):
        cli._bench(type("Args", (), {"name": "latency", "arguments": []})())


def test_serve_with_an_unset_key_variable_fails_before_starting(tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    monkeypatch.delenv("CALM_NO_SUCH_KEY", raising=False)
    result = _run("serve", str(tmp_path), "--api-key-env", "CALM_NO_SUCH_KEY")
    assert result.returncode == 1
    assert result.stderr.strip().startswith("ConfigError: the environment variable "
                                            "CALM_NO_SUCH_KEY")


CHILD_WITHOUT_TORCH = r'''
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)

sys.meta_path.insert(0, Block())
from calm_runtime.cli import main
sys.exit(main(sys.argv[1:]))
'''


@pytest.mark.parametrize("argv", [["fit", "--help"], ["train", "--model", "m", "--out", "o"],
                                  ["eval"], ["quickstart", "--limit", "3"]])
def test_training_commands_without_the_train_extra_are_one_line(tmp_path, argv):
    proc = subprocess.run([sys.executable, "-c", CHILD_WITHOUT_TORCH, *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("BackendUnavailableError: this command needs the train extra")
    assert "pip install 'calm-llm[train]'" in lines[0]


def test_unknown_options_are_still_refused(capsys):
    with pytest.raises(SystemExit) as info:
        main(["data", "list", "--no-such-option"])
    assert info.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_option_names_are_never_abbreviated(capsys):
    """``--api-key sk-...`` is not taken for ``--api-key-env`` (the key would be recorded in
    the adapter): every parser of ``calm`` and ``calm-export`` wants whole option names."""
    from calm_runtime.cli import main

    pytest.importorskip("calm_training.cli")
    with pytest.raises(SystemExit) as exc:
        main(["fit", "daca", "--model", "http://127.0.0.1:9/v1", "--reference", "m",
              "--data", "arc-easy", "--out", "x", "--api-key", "sk-secret"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --api-key sk-secret" in capsys.readouterr().err
    from calm_export.cli import build_parser

    assert build_parser().allow_abbrev is False
