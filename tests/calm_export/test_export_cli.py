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
    assert line.startswith("BackendUnavailableError: ") and "pip install 'calm[tensorrt]'" in line
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
