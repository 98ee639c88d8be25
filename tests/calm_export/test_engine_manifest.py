"""The engine contract (calm_runtime/formats/engine.py): strict reading, hashes, safe paths.

These tests build a synthetic engine folder (a hand-encoded graph proto naming its external
data, no weights) so they need neither torch nor onnx; the end-to-end tests check real engines.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import synthetic_genai_config, synthetic_onnx_graph

from calm_runtime.errors import ArtifactError, SchemaVersionError
from calm_runtime.files import sha256_file
from calm_runtime.formats.engine import (
    ENGINE_MANIFEST_NAME,
    ENGINE_SCHEMA_VERSION,
    EngineManifest,
    engine_io_names,
)

SHA = "0" * 64


def _engine(tmp_path, num_layers=2):
    root = tmp_path / "engine"
    root.mkdir()
    (root / "model.onnx").write_bytes(synthetic_onnx_graph("model.onnx.data"))
    (root / "model.onnx.data").write_bytes(b"weights" * 100)
    (root / "tokenizer.json").write_text('{"model": {}}')
    (root / "chat_template.jinja").write_text("{{ messages }}")
    (root / "genai_config.json").write_text(synthetic_genai_config(
        layers=num_layers, heads=4, kv_heads=2, head_size=16, hidden=64, context=256))
    inputs, outputs = engine_io_names(num_layers)
    data = {
        "schema_version": ENGINE_SCHEMA_VERSION, "kind": "onnx", "created_by": "test",
        "created_at": "2026-01-01T00:00:00+00:00",
        "source": {"model": {"name": "tiny", "vocab_size": 300, "tokenizer_sha256": SHA,
                             "weights_sha256": None},
                   "adapter": {"kind": "test", "path_name": "a", "tensors_sha256": SHA,
                               "manifest_sha256": None}},
        "calibration": {"fused": True, "temperature": 1.3, "answer_temperature": None,
                        "tau_min": 0.5, "tau_max": 2.0, "shift_min": -1.0, "shift_max": 1.0,
                        "adapter_kind": "test"},
        "model": {"file": "model.onnx",
                  "files": {n: sha256_file(root / n) for n in ("model.onnx", "model.onnx.data")},
                  "num_layers": num_layers, "num_attention_heads": 4, "num_kv_heads": 2,
                  "head_dim": 16, "hidden_size": 64, "vocab_size": 300,
                  "max_position_embeddings": 256, "dtype": "float32", "opset": 18,
                  "bos_token_id": 1, "eos_token_ids": [2], "pad_token_id": 3, "add_bos": True},
        "io": {"inputs": inputs, "outputs": outputs},
        "tokenizer": {"files": {n: sha256_file(root / n)
                                for n in ("tokenizer.json", "chat_template.jinja")},
                      "chat_template": "chat_template.jinja"},
        "option_tokens": {"plain": {" A": 260, " B": 261}, "chat": {"A": 36}},
        "p_true_template": {"name": "kadavath", "template": "Q: {question} A: {answer}",
                            "true_token": " A", "false_token": " B", "description": ""},
        "export": {"genai_config": {"file": "genai_config.json",
                                    "sha256": sha256_file(root / "genai_config.json")}},
        "validation": {"passed": True, "max_abs_diff": 1e-6, "tolerance": 1e-4,
                       "greedy_steps": 20, "greedy_match": True, "batch2_max_abs_diff": 1e-6},
    }
    _write(root, data)
    return root, data


def _write(root, data):
    (root / ENGINE_MANIFEST_NAME).write_text(json.dumps(data))


def test_valid_engine_loads_and_exposes_the_contract(tmp_path):
    root, _ = _engine(tmp_path)
    manifest = EngineManifest.load(root)
    assert manifest.kind == "onnx" and manifest.num_layers == 2 and manifest.vocab_size == 300
    assert manifest.model_path == (root / "model.onnx").resolve()
    assert manifest.p_true().true_token == " A"
    assert set(manifest.listed_files()) == {"model.onnx", "model.onnx.data", "tokenizer.json",
                                            "chat_template.jinja", "genai_config.json"}


def test_write_round_trips(tmp_path):
    root, _ = _engine(tmp_path)
    manifest = EngineManifest.load(root)
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in root.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    manifest.write(copy)
    assert EngineManifest.load(copy).to_dict() == manifest.to_dict()


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(extra=1), "unknown key"),
    (lambda d: d["model"].update(colour="red"), "unknown key"),
    (lambda d: d["model"].pop("head_dim"), "lacks required"),
    (lambda d: d.update(kind="gguf"), "kind"),
    (lambda d: d["model"].update(vocab_size=0), "positive integer"),
    (lambda d: d["model"].update(eos_token_ids=[300]), "token id"),
    (lambda d: d["calibration"].update(fused=False), "fused is false but the calibration"),
    (lambda d: d["calibration"].update(fused="yes"), "fused must be true or false"),
    (lambda d: d["calibration"].update(temperature=-1.0), "positive"),
    (lambda d: d["io"]["inputs"].reverse(), "inputs/outputs"),
    (lambda d: d["tokenizer"].update(chat_template="other.jinja"), "not listed"),
    (lambda d: d["option_tokens"]["plain"].update({" Z": 9999}), "token id"),
    (lambda d: d["validation"].update(passed=False), "did not pass"),
    (lambda d: d["p_true_template"].update(template="no placeholders"), "p_true_template"),
    (lambda d: d["source"]["model"].update(tokenizer_sha256="abc"), "sha256"),
])
def test_malformed_manifests_are_refused_with_one_line(tmp_path, edit, message):
    root, data = _engine(tmp_path)
    edit(data)
    _write(root, data)
    with pytest.raises(ArtifactError, match=message) as info:
        EngineManifest.load(root)
    assert "\n" not in str(info.value)


def test_newer_schema_is_refused(tmp_path):
    root, data = _engine(tmp_path)
    data["schema_version"] = ENGINE_SCHEMA_VERSION + 1
    _write(root, data)
    with pytest.raises(SchemaVersionError, match="upgrade calm"):
        EngineManifest.load(root)


@pytest.mark.parametrize("reference", ["../outside.onnx", "/etc/passwd"])
def test_files_outside_the_engine_are_refused(tmp_path, reference):
    root, data = _engine(tmp_path)
    (tmp_path / "outside.onnx").write_bytes(b"x")
    data["model"]["files"][reference] = SHA
    _write(root, data)
    with pytest.raises(ArtifactError, match="artifact"):
        EngineManifest.load(root)


def test_symlink_escaping_the_engine_is_refused(tmp_path):
    root, data = _engine(tmp_path)
    (tmp_path / "secret.bin").write_bytes(b"x")
    (root / "link.bin").symlink_to(tmp_path / "secret.bin")
    data["model"]["files"]["link.bin"] = sha256_file(tmp_path / "secret.bin")
    _write(root, data)
    with pytest.raises(ArtifactError, match="symlink"):
        EngineManifest.load(root)


def test_missing_truncated_and_modified_files_name_the_file_and_the_fix(tmp_path):
    root, _ = _engine(tmp_path)
    data_file = root / "model.onnx.data"
    data_file.write_bytes(data_file.read_bytes()[:10])  # truncated
    with pytest.raises(ArtifactError, match=r"model\.onnx\.data .*sha256.*re-export"):
        EngineManifest.load(root)
    EngineManifest.load(root, verify_hashes=False)  # presence only
    data_file.unlink()
    with pytest.raises(ArtifactError, match=r"model\.onnx\.data is missing.*copy the whole"):
        EngineManifest.load(root, verify_hashes=False)


def test_modified_genai_config_is_detected(tmp_path):
    root, _ = _engine(tmp_path)
    (root / "genai_config.json").write_text('{"changed": true}')
    with pytest.raises(ArtifactError, match="genai_config.json"):
        EngineManifest.load(root)


def test_not_an_engine_directory(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        EngineManifest.load(tmp_path / "nope")
    with pytest.raises(ArtifactError, match="calm_engine.json is missing"):
        EngineManifest.load(tmp_path)


def test_engine_module_imports_without_torch_or_onnx():
    code = ("import sys; import calm_runtime.formats.engine; "
            "bad = [m for m in ('torch', 'onnx', 'onnxruntime', 'transformers') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
