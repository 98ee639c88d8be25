"""calm-export's command line: help with an example, one-line errors, a final summary."""

from __future__ import annotations

import importlib.util

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
    from calm_export import pipeline

    real = pipeline.export_onnx  # the CLI is under test here; TorchScript is 20x faster
    monkeypatch.setattr(pipeline, "export_onnx",
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
    from calm_export import pipeline
    from calm_runtime.cli import build_parser
    from calm_runtime.cli import main as calm_main

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["export"]
    options = {s for a in sub._actions for s in a.option_strings}
    standalone = {s for a in export_cli.build_parser()._actions for s in a.option_strings}
    assert standalone - options == {"--quiet"}  # `calm -q export ...` instead

    real = pipeline.export_onnx
    monkeypatch.setattr(pipeline, "export_onnx",
                        lambda *a, **k: real(*a, **{**k, "exporter": "torchscript"}))
    out = tmp_path / "engine"
    assert calm_main(["-q", "export", "--model", str(tiny_llama_untied), "--out", str(out)]) == 0
    assert "parity: max |logit diff|" in capsys.readouterr().out
    assert (out / "calm_engine.json").is_file()
    assert calm_main(["-q", "export", "--model", str(tiny_llama_untied), "--out", str(out)]) == 1
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
from calm_runtime.cli import main as calm_main
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
