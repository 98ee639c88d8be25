"""calm-export's command line: help with an example, one-line errors, a final summary."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from calm_export.cli import main

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def test_help_shows_an_example(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "examples:" in text and "calm-export --model" in text and "--recalibrate" in text
    for flag in ("--adapter", "--out", "--format", "--dtype", "--quantize", "--opset",
                 "--overwrite", "--calibration-data", "--recalibrate", "--calibration-mode"):
        assert flag in text


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_existing_output_is_one_line_and_exit_1(tmp_path, capsys):
    out = tmp_path / "engine"
    out.mkdir()
    (out / "x").write_text("keep")
    code = main(["--model", str(tmp_path), "--out", str(out), "--quiet"])
    assert code == 1
    assert _error_line(capsys).startswith("ArtifactError: ")
    assert (out / "x").read_text() == "keep"


@pytest.mark.parametrize("flags, word", [
    (["--quantize", "int8", "--dtype", "fp16"], "quantize"),
    (["--recalibrate", "a.jsonl", "--calibration-data", "b.jsonl"], "different data"),
])
def test_inconsistent_options_are_config_errors(tmp_path, capsys, flags, word):
    code = main(["--model", "m", "--out", str(tmp_path / "e"), *flags, "--quiet"])
    assert code == 1
    line = _error_line(capsys)
    assert line.startswith("ConfigError: ") and word in line


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None,
                    reason="TensorRT is installed")
def test_tensorrt_without_tensorrt_names_the_extra(tmp_path, capsys):
    code = main(["--model", "no-such-model", "--out", str(tmp_path / "e"), "--format",
                 "tensorrt", "--quiet"])
    assert code == 1
    line = _error_line(capsys)
    assert line.startswith("BackendUnavailableError: ")
    assert "pip install 'calm-llm[tensorrt]'" in line
    assert not (tmp_path / "e").exists()


def test_export_prints_a_summary(tmp_path, capsys, tiny_llama_untied, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    from calm_export.graphs import calm_graph

    real = calm_graph.export_onnx  # the CLI is under test here; TorchScript is 20x faster
    monkeypatch.setattr(calm_graph, "export_onnx",
                        lambda *a, **k: real(*a, **{**k, "exporter": "torchscript"}))
    out = tmp_path / "engine"
    code = main(["--model", str(tiny_llama_untied), "--out", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "model.onnx" in captured.out and "parity: max |logit diff|" in captured.out
    assert "greedy 20 steps match" in captured.out and "time:" in captured.out
    assert (out / "calm_engine.json").is_file()
    assert main(["--model", str(tiny_llama_untied), "--out", str(out), "--quiet"]) == 1


def test_calm_export_subcommand_is_the_same_command(tmp_path, capsys, tiny_llama_untied,
                                                    monkeypatch):
    """``calm export`` takes calm-export's options and writes the same engine."""
    from calm_export import cli as export_cli
    from calm_export.graphs import calm_graph
    from calm_runtime.cli.main import build_parser
    from calm_runtime.cli.main import main as calm_main

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["export"]
    options = {s for a in sub._actions for s in a.option_strings}
    standalone = {s for a in export_cli.build_parser()._actions for s in a.option_strings}
    assert standalone <= options  # --quiet too: -q/-v are taken after any subcommand

    real = calm_graph.export_onnx
    monkeypatch.setattr(calm_graph, "export_onnx",
                        lambda *a, **k: real(*a, **{**k, "exporter": "torchscript"}))
    out = tmp_path / "engine"
    assert calm_main(["-q", "export", "--model", str(tiny_llama_untied), "--out", str(out)]) == 0
    assert "parity: max |logit diff|" in capsys.readouterr().out
    assert (out / "calm_engine.json").is_file()
    assert calm_main(["export", "--model", str(tiny_llama_untied), "--out", str(out),
                      "--quiet"]) == 1
    assert _error_line(capsys).startswith("ArtifactError: ")


CHILD_WITHOUT_EXPORT_EXTRA = r'''
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    """Behave as if the export extra (torch, onnx) were not installed."""
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in ("torch", "onnx", "onnxscript"):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)

sys.meta_path.insert(0, Block())
from calm_export.cli import main as export_main
from calm_runtime.cli.main import main as calm_main
sys.exit(export_main(sys.argv[2:]) if sys.argv[1] == "calm-export" else calm_main(sys.argv[2:]))
'''


@pytest.mark.parametrize("argv", [["calm-export", "--help"],
                                  ["calm-export", "--model", "m", "--out", "e"],
                                  ["calm", "export", "--help"],
                                  ["calm", "export", "--model", "m", "--out", "e"]])
def test_without_the_export_extra_every_use_is_one_line(tmp_path, argv):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", CHILD_WITHOUT_EXPORT_EXTRA, *argv],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and proc.stdout == "", proc.stderr
    assert lines[0].startswith("BackendUnavailableError: ")
    assert "export extra" in lines[0] and "pip install 'calm-llm[export]'" in lines[0]
    assert not (tmp_path / "e").exists()


def test_an_out_that_cannot_be_created_is_refused_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    # the model does not exist: the --out error must come first, before anything is loaded
    assert main(["--model", "no-such-model", "--out", str(blocker / "engine"), "--quiet"]) == 1
    line = _error_line(capsys)
    assert line.startswith("ArtifactError: cannot create") and "is not a folder" in line
    assert main(["--model", "no-such-model", "--out", str(blocker), "--quiet"]) == 1
    assert _error_line(capsys).startswith("ArtifactError: ")
    assert blocker.read_text() == "not a folder"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root writes into read-only folders")
def test_a_read_only_parent_is_refused_before_any_work(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert main(["--model", "no-such-model", "--out", str(locked / "e"), "--quiet"]) == 1
        assert "is not writable" in _error_line(capsys)
    finally:
        locked.chmod(0o700)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_parent_that_refuses_new_files_is_refused_before_any_work(capsys):
    """/proc takes no new folders, not even root's (whom os.access always allows)."""
    assert main(["--model", "no-such-model", "--out", "/proc/calm-engine", "--quiet"]) == 1
    line = _error_line(capsys)
    assert line.startswith("ArtifactError: cannot create /proc/calm-engine: /proc ")


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    from calm_export import pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "export_engine", interrupted)
    assert main(["--model", "m", "--out", str(tmp_path / "e"), "--quiet"]) == 130
    assert _error_line(capsys).startswith("Interrupted: stopped by SIGINT")


def test_sigterm_during_export_removes_the_staging_folder(tmp_path, tiny_llama_untied):
    """SIGTERM arrives while the engine is being built in its staging folder: one line, exit
    143, and nothing left next to --out (no engine, no .engine.tmp-* folder)."""
    import signal
    import subprocess
    import sys
    import time

    code = "import sys; from calm_export.cli import main; sys.exit(main(sys.argv[1:]))"
    out = tmp_path / "engine"
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", code, "--model",
                             str(tiny_llama_untied),
                             "--out", str(out), "--quiet"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".engine.tmp-*")) and proc.poll() is None:
        assert time.monotonic() < deadline, "the export never staged its folder"
        time.sleep(0.02)
    assert proc.poll() is None, f"the export ended before it could be stopped: {proc.stderr}"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    lines = [line for line in err.strip().splitlines() if not line.startswith("WARNING ")]
    assert len(lines) == 1 and lines[0].startswith("Interrupted: stopped by SIGTERM"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_a_long_stage_is_never_silent_and_no_bar_goes_to_a_log(monkeypatch, caplog):
    """Without a terminal, calm-export draws no bar (no carriage returns in a redirected log)
    and logs a heartbeat while a stage runs."""
    import io
    import logging
    import time

    from calm_export import progress

    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.2)
    fake_stderr = io.StringIO()
    monkeypatch.setattr(progress.sys, "stderr", fake_stderr)
    with caplog.at_level(logging.INFO, logger="calm_export"):
        stages = progress.StageProgress(["load", "export"], progress=True)
        stages.start("export")
        time.sleep(0.7)
        stages.close()
    assert "\r" not in fake_stderr.getvalue()
    beats = [r.message for r in caplog.records if "running for" in r.message]
    assert beats and beats[0].startswith("stage export: running for")


def test_every_export_option_default_is_the_config_field():
    """calm-export's defaults are ExportConfig's (one place for both)."""
    import dataclasses

    from calm_export import cli as export_cli
    from calm_export.config import ExportConfig

    fields = {f.name: f.default for f in dataclasses.fields(ExportConfig)}
    parser = export_cli.build_parser()
    for action in parser._actions:
        name = action.dest
        # --recalibrate DATA sets both calibration_data and the recalibrate flag
        if name in fields and action.option_strings and name != "recalibrate":
            assert action.default == fields[name], (name, action.default, fields[name])
    checked = {a.dest for a in parser._actions} & set(fields)
    assert {"format", "dtype", "quantize", "int8_scheme", "head_layout", "graph",
            "opset"} <= checked
