"""Broken LoRA folders, unusable --out paths and --overwrite on folders calm did not write:
one line each (``ErrorName: message``, exit 1), nothing left behind, nothing wiped."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from conftest import random_calibration_adapter, write_mc_jsonl  # noqa: E402

from calm_runtime.cli.main import main  # noqa: E402


def _one_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(prefix), err
    return err[0]


@pytest.fixture
def adapter_with_lora(tmp_path, tiny_llama_untied, tiny_lora_untied):
    adapter = random_calibration_adapter(tiny_llama_untied, lora_dir=tiny_lora_untied)
    adapter.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


@pytest.mark.parametrize("damage", ["weights", "config", "targets"])
@pytest.mark.parametrize("command", ["fit", "export"])
def test_a_broken_lora_folder_is_one_line(tmp_path, tiny_llama_untied, adapter_with_lora,
                                          capsys, monkeypatch, damage, command):
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    lora = adapter_with_lora / "lora"
    if damage == "weights":
        (lora / "adapter_model.safetensors").write_bytes(b"\x8f" * 4096)
    elif damage == "config":
        (lora / "adapter_config.json").write_text("{ not json")
    else:
        config = json.loads((lora / "adapter_config.json").read_text())
        config["target_modules"] = ["no_such_module"]
        (lora / "adapter_config.json").write_text(json.dumps(config))
    if command == "fit":
        data = write_mc_jsonl(tmp_path / "mc.jsonl")
        code = main(["fit", "ts", "--model", str(tiny_llama_untied), "--data", str(data),
                     "--adapter", str(adapter_with_lora), "--out", str(tmp_path / "out"), "-q"])
    else:
        code = main(["export", "--model", str(tiny_llama_untied), "--adapter",
                     str(adapter_with_lora), "--out", str(tmp_path / "out"), "-q"])
    assert code == 1
    _one_line(capsys, "ArtifactError: cannot apply the LoRA")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["onnx", "hf"])
def test_a_non_utf8_out_name_is_one_line_before_any_work(tmp_path, tiny_llama_untied, capsys,
                                                         fmt):
    out = str(tmp_path / "dir") + "\udcff"  # what argv gives for the byte 0xff
    assert main(["export", "--model", str(tiny_llama_untied), "--out", out, "--format", fmt,
                 "-q"]) == 1
    _one_line(capsys, "ArtifactError: --out")


def test_score_out_checked_first_and_nothing_left_behind(tmp_path, runtime_engine, capsys,
                                                         monkeypatch):
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    data = write_mc_jsonl(tmp_path / "mc.jsonl")
    existing = tmp_path / "reports"
    existing.mkdir()
    for out in ("/", str(existing)):
        assert main(["score", str(runtime_engine[2]), "--data", str(data), "--out", out]) == 1
        _one_line(capsys, "ConfigError: --out")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_hf_export_refuses_a_dangling_link_and_will_not_wipe_foreign_files(
        tmp_path, tiny_llama_untied, capsys):
    link = tmp_path / "ckpt"
    link.symlink_to(tmp_path / "nowhere")
    assert main(["export", "--model", str(tiny_llama_untied), "--format", "hf", "--out",
                 str(link), "-q"]) == 1
    _one_line(capsys, "ArtifactError: ")
    assert link.is_symlink()

    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "calm_checkpoint.json").write_text(json.dumps({"files": {}}))
    (folder / "my-notes.txt").write_text("keep me")
    assert main(["export", "--model", str(tiny_llama_untied), "--format", "hf", "--out",
                 str(folder), "--overwrite", "-q"]) == 1
    line = _one_line(capsys, "ArtifactError: ")
    assert "calm did not write" in line
    assert (folder / "my-notes.txt").read_text() == "keep me"
    shutil.rmtree(folder)
