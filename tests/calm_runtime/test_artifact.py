"""The calibration adapter artifact: round trip, math, and the bad-input battery.

Every refusal is checked for its exact error type, a one-line message, and (for writes)
that nothing was written or overwritten: the parent's listing and every byte of an
existing artifact are unchanged and no ``.NAME.tmp-*`` / ``.NAME.old-*`` folder is left.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import calm_runtime.formats.artifact as artifact_module
from calm_runtime.calibration import apply_calibration, fused_head
from calm_runtime.errors import (
    ArtifactError,
    CalmError,
    IncompatibleModelError,
    SchemaVersionError,
)
from calm_runtime.formats.artifact import (
    ADAPTER_SCHEMA_VERSION,
    MANIFEST_NAME,
    TENSORS_NAME,
    CalibrationAdapter,
    ModelIdentity,
)
from calm_runtime.formats.tokenizer_file import tokenizer_sha256

VOCAB = 16
HIDDEN = 6
TOKENIZER_SHA = "ab" * 32
# float32 parity of W' h + b' against calibrate(W h + b): the fused form rounds
# 1/(tau*T) once before a d-term sum, the unfused form divides after it.
FUSED_RTOL = 1e-5

METHOD = {"name": "daca", "config": {"n_bins": 15, "lr": 0.01, "features": ["a", "b"]}}
METRICS = {"ece_before": 0.21, "ece_after": 0.034, "n": 512}
PROVENANCE = {"dataset": "toy-mcq", "dataset_sha256": "cd" * 32, "seed": 7,
              "calm_version": "0.1.0"}
P_TRUE_TEMPLATE = {"name": "custom", "template": "Q: {question}\nA: {answer}\nTrue?",
                   "true_token": " Yes", "false_token": " No"}


# ---------------------------------------------------------------------- helpers
def _identity(vocab: int = VOCAB, sha: str | None = TOKENIZER_SHA) -> ModelIdentity:
    return ModelIdentity("tiny-llama", vocab, sha)


def _tau(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.5, 2.0, VOCAB).astype(np.float32)


def _shift(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + 100).normal(size=VOCAB).astype(np.float32)


def _adapter(**overrides) -> CalibrationAdapter:
    fields = {
        "base_model": _identity(), "tau": _tau(), "shift": _shift(),
        # exactly representable in float32, so the round trip is exact
        "temperature": 1.25, "answer_temperature": 0.75, "kind": "daca",
        "method": METHOD, "metrics": METRICS, "provenance": PROVENANCE,
        "p_true_template": P_TRUE_TEMPLATE,
    }
    fields.update(overrides)
    return CalibrationAdapter(**fields)


def _fake_lora(folder: Path) -> Path:
    """A peft-shaped LoRA folder: adapter_config.json plus a small safetensors file."""
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
              "base_model_name_or_path": "tiny-llama", "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(3)
    save_file({"base_model.model.layers.0.self_attn.q_proj.lora_A.weight":
               rng.normal(size=(2, HIDDEN)).astype(np.float32),
               "base_model.model.layers.0.self_attn.q_proj.lora_B.weight":
               np.zeros((HIDDEN, 2), np.float32)},
              str(folder / "adapter_model.safetensors"))
    return folder


def _snapshot(root: Path) -> dict[str, object]:
    """Every entry under ``root``: file bytes, symlink targets, directories."""
    if not root.exists() and not root.is_symlink():
        return {}
    if root.is_file():
        return {".": root.read_bytes()}
    tree: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                tree[rel] = ("symlink", os.readlink(path))
            elif path.is_dir():
                tree[rel] = "dir"
            else:
                tree[rel] = path.read_bytes()
    return tree


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir()
                  if p.name.startswith((f".{name}.tmp-", f".{name}.old-")))


def _expect(exc_type: type[CalmError], fn: Callable, *args, match: str | None = None,
            **kwargs) -> str:
    """Call ``fn``; require exactly ``exc_type`` with a one-line message matching ``match``."""
    with pytest.raises(CalmError) as info:
        fn(*args, **kwargs)
    err = info.value
    assert type(err) is exc_type, f"expected {exc_type.__name__}, got {type(err).__name__}: {err}"
    message = str(err)
    assert "\n" not in message, f"message is not one line: {message!r}"
    if match is not None:
        assert re.search(match, message), f"{match!r} not in {message!r}"
    return message


@pytest.fixture
def work(tmp_path: Path) -> Path:
    folder = tmp_path / "work"
    folder.mkdir()
    return folder


@pytest.fixture
def saved(work: Path) -> Path:
    """A complete artifact with a LoRA folder at ``work/adapter``."""
    lora = _fake_lora(work / "peft_src")
    return _adapter(lora_path=lora).save_pretrained(work / "adapter")


def _edit_manifest(root: Path, edit: Callable[[dict], None]) -> None:
    path = root / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _edit_tensors(root: Path, edit: Callable[[dict], None]) -> None:
    path = root / TENSORS_NAME
    arrays = dict(load_file(str(path)))
    edit(arrays)
    path.unlink()
    save_file(arrays, str(path))


def _raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    """Write a safetensors file by hand (for dtypes numpy cannot produce)."""
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


# ---------------------------------------------------------------------- round trip
def test_round_trip_keeps_everything(work: Path):
    lora_src = _fake_lora(work / "peft_src")
    lora_before = _snapshot(lora_src)
    adapter = _adapter(lora_path=lora_src)
    target = adapter.save_pretrained(work / "adapter")
    assert target == work / "adapter"
    assert sorted(p.name for p in target.iterdir()) == sorted(
        [MANIFEST_NAME, TENSORS_NAME, "lora"])
    assert _leftovers(work, "adapter") == []
    assert _snapshot(lora_src) == lora_before, "the source LoRA folder was modified"
    assert adapter.lora_path == target / "lora"

    loaded = CalibrationAdapter.from_pretrained(target)
    np.testing.assert_array_equal(loaded.tau, adapter.tau)
    np.testing.assert_array_equal(loaded.shift, adapter.shift)
    assert loaded.tau.dtype == np.float32 and loaded.shift.dtype == np.float32
    assert loaded.temperature == 1.25
    assert loaded.answer_temperature == 0.75
    assert loaded.base_model == _identity()
    assert loaded.kind == "daca"
    assert loaded.method == METHOD
    assert loaded.metrics == METRICS
    assert loaded.provenance == PROVENANCE
    assert loaded.p_true_template == P_TRUE_TEMPLATE
    assert loaded.created_by == adapter.created_by
    assert loaded.created_at == adapter.created_at and loaded.created_at
    assert loaded.lora_path == target / "lora"
    # the LoRA folder is copied byte for byte (not linked)
    assert _snapshot(target / "lora") == lora_before
    assert not any(p.is_symlink() for p in (target / "lora").rglob("*"))

    manifest = json.loads((target / MANIFEST_NAME).read_text())
    assert manifest["schema_version"] == ADAPTER_SCHEMA_VERSION == 1
    assert manifest["base_model"] == {"name": "tiny-llama", "vocab_size": VOCAB,
                                      "tokenizer_sha256": TOKENIZER_SHA}
    assert manifest["tensors"]["file"] == TENSORS_NAME
    assert manifest["tensors"]["entries"] == {
        "tau": {"shape": [VOCAB], "dtype": "float32"},
        "shift": {"shape": [VOCAB], "dtype": "float32"},
        "temperature": {"shape": [], "dtype": "float32"},
        "answer_temperature": {"shape": [], "dtype": "float32"},
    }
    assert manifest["lora"] == "lora"
    assert manifest["summary"]["has_lora"] is True
    assert manifest["summary"]["tau_min"] == pytest.approx(float(adapter.tau.min()))
    stored = load_file(str(target / TENSORS_NAME))
    assert {k: (v.dtype, v.shape) for k, v in stored.items()} == {
        "tau": (np.float32, (VOCAB,)), "shift": (np.float32, (VOCAB,)),
        "temperature": (np.float32, ()), "answer_temperature": (np.float32, ())}

    # a loaded adapter saves again (its LoRA now comes from inside the first artifact)
    again = CalibrationAdapter.from_pretrained(loaded.save_pretrained(work / "copy"))
    np.testing.assert_array_equal(again.tau, adapter.tau)
    assert _snapshot(work / "copy" / "lora") == lora_before
    assert again.metrics == METRICS and again.created_at == loaded.created_at


def test_round_trip_minimal_identity(work: Path):
    adapter = CalibrationAdapter.identity(_identity(sha=None))
    loaded = CalibrationAdapter.from_pretrained(adapter.save_pretrained(work / "ident"))
    np.testing.assert_array_equal(loaded.tau, np.ones(VOCAB, np.float32))
    np.testing.assert_array_equal(loaded.shift, np.zeros(VOCAB, np.float32))
    assert loaded.temperature == 1.0 and loaded.answer_temperature is None
    assert loaded.lora_path is None and loaded.p_true_template is None
    assert loaded.kind == "identity" and loaded.base_model.tokenizer_sha256 is None
    assert loaded.method == {} and loaded.metrics == {} and loaded.provenance == {}
    assert sorted(p.name for p in (work / "ident").iterdir()) == sorted(
        [MANIFEST_NAME, TENSORS_NAME])
    assert set(load_file(str(work / "ident" / TENSORS_NAME))) == {"tau", "shift",
                                                                   "temperature"}
    assert json.loads((work / "ident" / MANIFEST_NAME).read_text())["lora"] is None


def test_save_accepts_float64_and_numpy_scalars_and_stores_float32(work: Path):
    adapter = _adapter(temperature=np.float32(1.5), answer_temperature=np.float64(0.5))
    assert adapter.temperature == 1.5 and type(adapter.temperature) is float
    adapter.tau = _tau().astype(np.float64)  # the fields are mutable
    adapter.save_pretrained(work / "a")
    stored = load_file(str(work / "a" / TENSORS_NAME))
    assert stored["tau"].dtype == np.float32, "manifest says float32, so must the file"
    np.testing.assert_array_equal(stored["tau"], _tau())


# ---------------------------------------------------------------------- math
def _logits(dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(11).normal(size=(3, 4, VOCAB)).astype(dtype)


def test_calibrate_numpy_and_torch():
    adapter = _adapter()
    z = _logits()
    expected = apply_calibration(z, adapter.tau, adapter.shift, adapter.temperature)
    got = adapter.calibrate(z)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_allclose(
        got, (z.astype(np.float64) / adapter.tau + adapter.shift) / 1.25, rtol=1e-6, atol=1e-6)

    got_t = adapter.calibrate(torch.from_numpy(z))
    assert isinstance(got_t, torch.Tensor) and got_t.dtype == torch.float32
    np.testing.assert_array_equal(got_t.numpy(), expected)

    got_64 = adapter.calibrate(torch.from_numpy(z.astype(np.float64)))
    assert got_64.dtype == torch.float64
    np.testing.assert_allclose(got_64.numpy(), expected, rtol=1e-6, atol=1e-6)

    identity = CalibrationAdapter.identity(_identity())
    np.testing.assert_array_equal(identity.calibrate(z), z)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_fused_head_numpy_and_torch(with_bias):
    adapter = _adapter()
    rng = np.random.default_rng(12)
    weight = rng.normal(size=(VOCAB, HIDDEN)).astype(np.float32)
    bias = rng.normal(size=VOCAB).astype(np.float32) if with_bias else None
    hidden = rng.normal(size=(5, HIDDEN)).astype(np.float32)

    new_w, new_b = adapter.fused_head(weight, bias)
    ref_w, ref_b = fused_head(weight, bias, adapter.tau, adapter.shift, adapter.temperature)
    np.testing.assert_array_equal(new_w, ref_w)
    np.testing.assert_array_equal(new_b, ref_b)
    z = hidden @ weight.T + (0 if bias is None else bias)
    fused = hidden @ new_w.T + new_b
    unfused = adapter.calibrate(z)
    err = np.abs(fused - unfused).max() / max(1.0, np.abs(unfused).max())
    assert err <= FUSED_RTOL, f"max scaled |fused - unfused| {err:.3g} > {FUSED_RTOL}"

    t_w, t_b = adapter.fused_head(torch.from_numpy(weight),
                                  None if bias is None else torch.from_numpy(bias))
    assert isinstance(t_w, torch.Tensor) and isinstance(t_b, torch.Tensor)
    np.testing.assert_array_equal(t_w.numpy(), new_w)
    np.testing.assert_array_equal(t_b.numpy(), new_b)


# ---------------------------------------------------------------------- bad values
def _tau_with_nonpositive() -> np.ndarray:
    tau = _tau()
    tau[3], tau[9] = -0.2, 0.0
    return tau


def _with(array: np.ndarray, index: int, value: float) -> np.ndarray:
    array = array.copy()
    array[index] = value
    return array


BAD_FIELDS = {
    "tau_short": ({"tau": np.ones(VOCAB - 1)}, r"tau has shape \[15\] but the vocabulary has 16"),
    "tau_long": ({"tau": np.ones(VOCAB + 1)}, r"tau has shape \[17\]"),
    "tau_2d": ({"tau": np.ones((1, VOCAB))}, r"tau has shape \[1, 16\]"),
    "shift_short": ({"shift": np.zeros(VOCAB - 2)}, r"shift has shape \[14\]"),
    "tau_nan": ({"tau": _with(_tau(), 4, np.nan)}, r"tau has 1 non-finite .*token id 4"),
    "tau_inf": ({"tau": _with(_tau(), 6, np.inf)}, r"tau has 1 non-finite .*token id 6"),
    "shift_nan": ({"shift": _with(_shift(), 0, np.nan)}, r"shift has 1 non-finite .*id 0"),
    "shift_neg_inf": ({"shift": _with(_shift(), 15, -np.inf)}, r"shift .*token id 15"),
    "tau_nonpositive": ({"tau": _tau_with_nonpositive()},
                        r"^tau must be positive; 2 entries are <= 0 \(first at token id 3: "
                        r"-0\.2\)"),
    "temperature_zero": ({"temperature": 0.0}, r"temperature must be positive, got 0"),
    "temperature_negative": ({"temperature": -1.0}, r"temperature must be positive"),
    "temperature_nan": ({"temperature": float("nan")}, r"temperature is nan, not finite"),
    "temperature_inf": ({"temperature": float("inf")}, r"temperature is inf"),
    "temperature_string": ({"temperature": "1.0"}, r"temperature must be a number"),
    "temperature_bool": ({"temperature": True}, r"temperature must be a number"),
    "answer_temperature_zero": ({"answer_temperature": 0.0},
                                r"answer_temperature must be positive"),
    "answer_temperature_negative": ({"answer_temperature": -0.5},
                                    r"answer_temperature must be positive"),
    "answer_temperature_nan": ({"answer_temperature": float("nan")},
                               r"answer_temperature is nan"),
}


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_bad_values_refused_at_construction(case):
    fields, match = BAD_FIELDS[case]
    _expect(ArtifactError, _adapter, match=match, **fields)


def test_bad_vocab_size_refused():
    _expect(ArtifactError, CalibrationAdapter, base_model=_identity(vocab=0),
            tau=np.ones(0), shift=np.zeros(0), match="vocab_size must be a positive integer")


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_bad_values_refused_at_save_and_nothing_written(work: Path, case):
    fields, match = BAD_FIELDS[case]
    adapter = _adapter()
    for name, value in fields.items():  # a valid adapter edited after construction
        setattr(adapter, name, value)
    before = _snapshot(work)
    _expect(ArtifactError, adapter.save_pretrained, work / "out", match=match)
    assert _snapshot(work) == before, "a refused save wrote something"

    existing = _adapter(tau=_tau(5)).save_pretrained(work / "old")
    before = _snapshot(work)
    _expect(ArtifactError, adapter.save_pretrained, existing, overwrite=True, match=match)
    assert _snapshot(work) == before, "a refused save changed the existing artifact"


def test_save_refuses_lora_without_adapter_config(work: Path):
    lora = _fake_lora(work / "peft_src")
    (lora / "adapter_config.json").unlink()
    before = _snapshot(work)
    _expect(ArtifactError, _adapter(lora_path=lora).save_pretrained, work / "out",
            match="no adapter_config.json")
    _expect(ArtifactError, _adapter(lora_path=work / "nowhere").save_pretrained, work / "out",
            match="no adapter_config.json")
    assert _snapshot(work) == before


def test_save_refuses_unstorable_metrics(work: Path):
    before = _snapshot(work)
    _expect(ArtifactError, _adapter(metrics={"auroc": float("nan")}).save_pretrained,
            work / "out", match=r"calm_adapter\.json.*NaN")
    _expect(ArtifactError, _adapter(provenance={"when": object()}).save_pretrained,
            work / "out", match="cannot store object")
    assert _snapshot(work) == before
    assert _leftovers(work, "out") == []


# ---------------------------------------------------------------------- bad artifacts
def _set(key: str, value) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        data[key] = value
    return edit


def _delete(key: str) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        del data[key]
    return edit


def _manifest(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda root: _edit_manifest(root, edit)


def _tensors(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda root: _edit_tensors(root, edit)


def _outside_tensor_copy(root: Path) -> Path:
    """A valid copy of the tensors file next to (outside) the artifact."""
    outside = root.parent / "x.safetensors"
    shutil.copyfile(root / TENSORS_NAME, outside)
    return outside


def _reference_dotdot(root: Path) -> None:
    _outside_tensor_copy(root)
    _edit_manifest(root, lambda m: m["tensors"].update(file="../x.safetensors"))


def _reference_absolute(root: Path) -> None:
    outside = _outside_tensor_copy(root)
    _edit_manifest(root, lambda m: m["tensors"].update(file=str(outside.resolve())))


def _reference_symlink_outside(root: Path) -> None:
    outside = _outside_tensor_copy(root)
    (root / TENSORS_NAME).unlink()
    (root / TENSORS_NAME).symlink_to(outside)


def _lora_dotdot(root: Path) -> None:
    shutil.copytree(root / "lora", root.parent / "lora_outside")
    _edit_manifest(root, _set("lora", "../lora_outside"))


def _lora_symlink_outside(root: Path) -> None:
    shutil.move(str(root / "lora"), str(root.parent / "lora_outside"))
    (root / "lora").symlink_to(root.parent / "lora_outside", target_is_directory=True)


def _truncate(n_bytes: int) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        path = root / TENSORS_NAME
        path.write_bytes(path.read_bytes()[:n_bytes])
    return edit


def _random_bytes(root: Path) -> None:
    (root / TENSORS_NAME).write_bytes(np.random.default_rng(0).bytes(512))


def _bf16_tensor(root: Path) -> None:
    # what a torch training loop writes when it saves bf16 parameters
    header = {"tau": {"dtype": "BF16", "shape": [VOCAB], "data_offsets": [0, 2 * VOCAB]},
              "shift": {"dtype": "F32", "shape": [VOCAB], "data_offsets": [2 * VOCAB,
                                                                           6 * VOCAB]},
              "temperature": {"dtype": "F32", "shape": [], "data_offsets": [6 * VOCAB,
                                                                           6 * VOCAB + 4]}}
    data = b"\x80\x3f" * VOCAB + np.zeros(VOCAB, np.float32).tobytes() + b"\x00\x00\x80\x3f"
    _raw_safetensors(root / TENSORS_NAME, header, data)


def _write_manifest_text(text: str | bytes) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        path = root / MANIFEST_NAME
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
    return edit


def _nan_in_manifest(root: Path) -> None:
    path = root / MANIFEST_NAME
    data = json.loads(path.read_text())
    data["metrics"]["ece_after"] = float("nan")
    path.write_text(json.dumps(data))  # json writes the bare NaN literal


def _remove(relative: str) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        path = root / relative
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return edit


def _set_tensor(name: str, value) -> Callable[[dict], None]:
    def edit(arrays: dict) -> None:
        arrays[name] = np.asarray(value, np.float32)
    return edit


def _drop_tensor(name: str) -> Callable[[dict], None]:
    def edit(arrays: dict) -> None:
        del arrays[name]
    return edit


BAD_ARTIFACTS: dict[str, tuple[Callable[[Path], None], type[CalmError], str]] = {
    # manifest keys
    "unknown_top_key": (_manifest(_set("calibration", {})), ArtifactError,
                        r"unknown key\(s\) \['calibration'\]"),
    "unknown_base_model_key": (
        _manifest(lambda m: m["base_model"].update(revision="main")), ArtifactError,
        r"base_model has unknown key\(s\) \['revision'\]"),
    "unknown_tensors_section_key": (
        _manifest(lambda m: m["tensors"].update(sha256="00")), ArtifactError,
        r"tensors has unknown key\(s\) \['sha256'\]"),
    "missing_kind": (_manifest(_delete("kind")), ArtifactError,
                     r"lacks required key\(s\) \['kind'\]"),
    "missing_base_model_vocab": (_manifest(lambda m: m["base_model"].pop("vocab_size")),
                                 ArtifactError, r"lacks required key\(s\) \['vocab_size'\]"),
    "base_model_not_object": (_manifest(_set("base_model", "tiny-llama")), ArtifactError,
                              "base_model must be an object"),
    "tensors_not_object": (_manifest(_set("tensors", TENSORS_NAME)), ArtifactError,
                           "tensors must be an object"),
    "method_not_object": (_manifest(_set("method", ["daca"])), ArtifactError,
                          "method must be an object"),
    "kind_empty": (_manifest(_set("kind", "")), ArtifactError, "kind must be a non-empty"),
    "vocab_size_string": (_manifest(lambda m: m["base_model"].update(vocab_size="16")),
                          ArtifactError, "vocab_size must be a positive integer"),
    "vocab_mismatch": (_manifest(lambda m: m["base_model"].update(vocab_size=2 * VOCAB)),
                       ArtifactError, r"tau has shape \[16\] but the vocabulary has 32"),
    # schema version
    "schema_newer": (_manifest(_set("schema_version", ADAPTER_SCHEMA_VERSION + 1)),
                     SchemaVersionError, r"schema_version 2, newer than this calm supports"),
    "schema_string": (_manifest(_set("schema_version", "1")), ArtifactError,
                      r"schema_version '1', expected a positive integer"),
    "schema_float": (_manifest(_set("schema_version", 1.0)), ArtifactError,
                     r"schema_version 1\.0, expected a positive integer"),
    "schema_bool": (_manifest(_set("schema_version", True)), ArtifactError,
                    r"schema_version True"),
    "schema_zero": (_manifest(_set("schema_version", 0)), ArtifactError, r"schema_version 0"),
    "schema_missing": (_manifest(_delete("schema_version")), ArtifactError,
                       r"schema_version None"),
    # tensors in the file
    "unknown_tensor": (_tensors(_set_tensor("log_tau", np.zeros(VOCAB))), ArtifactError,
                       r"unknown tensor\(s\) \['log_tau'\]"),
    "missing_tau": (_tensors(_drop_tensor("tau")), ArtifactError,
                    r"lacks tensor\(s\) \['tau'\]"),
    "missing_shift": (_tensors(_drop_tensor("shift")), ArtifactError,
                      r"lacks tensor\(s\) \['shift'\]"),
    "missing_temperature": (_tensors(_drop_tensor("temperature")), ArtifactError,
                            r"lacks tensor\(s\) \['temperature'\]"),
    "tau_wrong_shape": (_tensors(_set_tensor("tau", np.ones(VOCAB + 3))), ArtifactError,
                        r"tau has shape \[19\] but the vocabulary has 16"),
    "shift_wrong_shape": (_tensors(_set_tensor("shift", np.zeros((2, VOCAB)))), ArtifactError,
                          r"shift has shape \[2, 16\]"),
    "tau_nan": (_tensors(_set_tensor("tau", _with(_tau(), 2, np.nan))), ArtifactError,
                r"tau has 1 non-finite entries \(first at token id 2: nan\)"),
    "shift_inf": (_tensors(_set_tensor("shift", _with(_shift(), 7, np.inf))), ArtifactError,
                  r"shift has 1 non-finite entries \(first at token id 7: inf\)"),
    "tau_nonpositive": (_tensors(_set_tensor("tau", _tau_with_nonpositive())), ArtifactError,
                        r"2 entries are <= 0 \(first at token id 3: -0\.2\)"),
    "temperature_zero": (_tensors(_set_tensor("temperature", 0.0)), ArtifactError,
                         "temperature must be positive"),
    "temperature_nan": (_tensors(_set_tensor("temperature", np.nan)), ArtifactError,
                        "temperature is nan"),
    "answer_temperature_negative": (_tensors(_set_tensor("answer_temperature", -1.0)),
                                    ArtifactError, "answer_temperature must be positive"),
    "temperature_not_scalar": (_tensors(_set_tensor("temperature", [1.0, 2.0])),
                               ArtifactError, r"temperature must be a scalar, got shape \[2\]"),
    "bf16_tensor": (_bf16_tensor, ArtifactError,
                    "not a readable safetensors file|is bfloat16, not float32"),
    # file references
    "reference_dotdot": (_reference_dotdot, ArtifactError, r"escapes the artifact directory"),
    "reference_absolute": (_reference_absolute, ArtifactError, r"is an absolute path"),
    "reference_symlink_outside": (_reference_symlink_outside, ArtifactError,
                                  r"resolves outside the artifact directory"),
    "reference_empty": (_manifest(lambda m: m["tensors"].update(file="")), ArtifactError,
                        "not a non-empty string"),
    "lora_dotdot": (_lora_dotdot, ArtifactError, r"'\.\./lora_outside' escapes"),
    "lora_symlink_outside": (_lora_symlink_outside, ArtifactError,
                             r"'lora' resolves outside the artifact directory"),
    "lora_without_adapter_config": (_remove("lora/adapter_config.json"), ArtifactError,
                                    "has no adapter_config.json"),
    "lora_folder_missing": (_remove("lora"), ArtifactError, "has no adapter_config.json"),
    # damaged files
    "tensors_truncated": (_truncate(-10), ArtifactError, "not a readable safetensors file"),
    "tensors_truncated_header": (_truncate(20), ArtifactError,
                                 "not a readable safetensors file"),
    "tensors_empty": (_truncate(0), ArtifactError, "not a readable safetensors file"),
    "tensors_random_bytes": (_random_bytes, ArtifactError, "not a readable safetensors file"),
    "tensors_missing": (_remove(TENSORS_NAME), ArtifactError, "is missing"),
    "manifest_invalid_json": (_write_manifest_text('{"schema_version": 1,'), ArtifactError,
                              "is not valid JSON"),
    "manifest_not_utf8": (_write_manifest_text(b"\xff\xfe\x00{"), ArtifactError,
                          "is not valid JSON"),
    "manifest_array": (_write_manifest_text("[1, 2]"), ArtifactError,
                       "must hold a JSON object"),
    "manifest_nan": (_nan_in_manifest, ArtifactError, "NaN is not allowed"),
    "manifest_missing": (_remove(MANIFEST_NAME), ArtifactError,
                         r"calm_adapter\.json is missing"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARTIFACTS))
def test_bad_artifact_refused_on_load(saved: Path, case):
    damage, exc_type, match = BAD_ARTIFACTS[case]
    damage(saved)
    before = _snapshot(saved.parent)
    _expect(exc_type, CalibrationAdapter.from_pretrained, saved, match=match)
    assert _snapshot(saved.parent) == before, "loading changed files"


def test_manifest_fixture_loads_untouched(saved: Path):
    # the battery's baseline: the undamaged artifact loads
    assert CalibrationAdapter.from_pretrained(saved).lora_path == saved / "lora"


def test_missing_directory_refused(work: Path):
    _expect(ArtifactError, CalibrationAdapter.from_pretrained, work / "nope",
            match="does not exist")
    (work / "a_file").write_text("x")
    _expect(ArtifactError, CalibrationAdapter.from_pretrained, work / "a_file",
            match="does not exist")


def test_escaping_reference_is_refused_even_when_target_is_valid(saved: Path):
    # the outside copies the battery points at are themselves loadable: the refusal is
    # about the reference, not about a broken file
    _reference_dotdot(saved)
    assert set(load_file(str(saved.parent / "x.safetensors"))) >= {"tau", "shift"}
    _expect(ArtifactError, CalibrationAdapter.from_pretrained, saved, match="escapes")


# ---------------------------------------------------------------------- overwrite
def test_save_to_existing_directory_without_overwrite(work: Path, saved: Path):
    before = _snapshot(work)
    _expect(ArtifactError, _adapter(tau=_tau(9)).save_pretrained, saved,
            match="already exists.*overwrite=True")
    assert _snapshot(work) == before
    # an unrelated existing folder is not touched either
    other = work / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    before = _snapshot(work)
    _expect(ArtifactError, _adapter().save_pretrained, other, match="already exists")
    assert _snapshot(work) == before


def test_save_with_overwrite_replaces(work: Path, saved: Path):
    # a file calm did not write stops --overwrite (it would be wiped with the folder)
    (saved / "stale.txt").write_text("not calm's")
    new = _adapter(tau=_tau(9), kind="temperature", lora_path=None)
    with pytest.raises(ArtifactError, match="calm did not write"):
        new.save_pretrained(saved, overwrite=True)
    assert (saved / "stale.txt").read_text() == "not calm's"
    (saved / "stale.txt").unlink()
    assert new.save_pretrained(saved, overwrite=True) == saved
    loaded = CalibrationAdapter.from_pretrained(saved)
    np.testing.assert_array_equal(loaded.tau, _tau(9))
    assert loaded.kind == "temperature" and loaded.lora_path is None
    assert sorted(p.name for p in saved.iterdir()) == sorted([MANIFEST_NAME, TENSORS_NAME])
    assert _leftovers(work, saved.name) == []


def _fail_tensor_write(tensors, filename, *args, **kwargs):
    Path(filename).write_bytes(b"partial")
    raise OSError("No space left on device")


_REAL_WRITE_JSON = artifact_module.write_json


def _fail_manifest_write(path, payload):
    Path(path).write_text('{"schema_version": 1, "ki')
    raise OSError("No space left on device")


def _corrupt_then_write_manifest(path, payload):
    # writes a complete manifest but damages the tensors first: the verify step must catch it
    tensors = Path(path).parent / TENSORS_NAME
    tensors.write_bytes(tensors.read_bytes()[:-4])
    _REAL_WRITE_JSON(path, payload)


def _fail_copytree(src, dst, *args, **kwargs):
    Path(dst).mkdir()
    (Path(dst) / "adapter_config.json").write_text("{}")
    raise OSError("Input/output error")


FAILURES = {
    "tensor_write": ("safetensors.numpy.save_file", _fail_tensor_write, OSError),
    "manifest_write": ("calm_runtime.formats.artifact.write_json", _fail_manifest_write, OSError),
    "verify_step": ("calm_runtime.formats.artifact.write_json", _corrupt_then_write_manifest,
                    ArtifactError),
    "lora_copy": ("calm_runtime.formats.artifact.shutil.copytree", _fail_copytree, OSError),
}


@pytest.mark.parametrize("overwrite", [True, False], ids=["over_existing", "fresh"])
@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_save_failing_midway_leaves_nothing(work: Path, saved: Path, monkeypatch, failure,
                                            overwrite):
    target_path, fake, exc_type = FAILURES[failure]
    monkeypatch.setattr(target_path, fake)
    target = saved if overwrite else work / "fresh"
    before = _snapshot(work)
    new = _adapter(tau=_tau(9), lora_path=saved / "lora")
    with pytest.raises(exc_type) as info:
        new.save_pretrained(target, overwrite=overwrite)
    assert "\n" not in str(info.value)
    monkeypatch.undo()
    assert _snapshot(work) == before, "a failed save left the directory changed"
    assert _leftovers(work, target.name) == []
    if overwrite:
        loaded = CalibrationAdapter.from_pretrained(saved)
        np.testing.assert_array_equal(loaded.tau, _tau())
    else:
        assert not target.exists()


# ---------------------------------------------------------------------- model identity
def test_check_compatible_vocab_mismatch():
    _identity().check_compatible(_identity())
    message = _expect(IncompatibleModelError, _identity(VOCAB).check_compatible,
                      ModelIdentity("other", VOCAB + 1, TOKENIZER_SHA))
    assert "16" in message and "17" in message and "other" in message


def test_check_compatible_tokenizer_mismatch():
    message = _expect(IncompatibleModelError, _identity().check_compatible,
                      _identity(sha="cd" * 32), what="engine")
    assert "abababababab" in message and "cdcdcdcdcdcd" in message and "engine" in message
    # an unknown tokenizer hash on either side is not a mismatch
    _identity(sha=None).check_compatible(_identity())
    _identity().check_compatible(_identity(sha=None))


def test_tokenizer_sha256(work: Path):
    (work / "tokenizer.json").write_text('{"model": {"vocab": {}}}')
    expected = hashlib.sha256(b'{"model": {"vocab": {}}}').hexdigest()
    assert tokenizer_sha256(work) == expected
    _expect(IncompatibleModelError, tokenizer_sha256, work / "empty",
            match="no tokenizer.json")


# ---------------------------------------------------------------------- migrations
def test_migration_upgrades_an_old_manifest(saved: Path, monkeypatch):
    calls = []

    def v1_to_v2(data: dict) -> dict:
        calls.append(data["schema_version"])
        data["provenance"] = {**data["provenance"], "migrated_from_schema": 1}
        return data

    on_disk = _snapshot(saved)
    monkeypatch.setattr(artifact_module, "ADAPTER_SCHEMA_VERSION", 2)
    monkeypatch.setattr(artifact_module, "MIGRATIONS", {1: v1_to_v2})
    loaded = CalibrationAdapter.from_pretrained(saved)
    assert calls == [1]
    assert loaded.provenance == {**PROVENANCE, "migrated_from_schema": 1}
    np.testing.assert_array_equal(loaded.tau, _tau())
    assert _snapshot(saved) == on_disk, "reading migrated the files in place"

    # saved again, it is a version-2 artifact that loads without migrating
    loaded.save_pretrained(saved.parent / "v2")
    manifest = json.loads((saved.parent / "v2" / MANIFEST_NAME).read_text())
    assert manifest["schema_version"] == 2
    assert CalibrationAdapter.from_pretrained(saved.parent / "v2").provenance[
        "migrated_from_schema"] == 1
    assert calls == [1]


def test_migrations_run_in_order(saved: Path, monkeypatch):
    steps = []

    def step(version: int):
        def migrate(data: dict) -> dict:
            assert data["schema_version"] == version
            steps.append(version)
            return data
        return migrate

    monkeypatch.setattr(artifact_module, "ADAPTER_SCHEMA_VERSION", 4)
    monkeypatch.setattr(artifact_module, "MIGRATIONS", {3: step(3), 1: step(1), 2: step(2)})
    CalibrationAdapter.from_pretrained(saved)
    assert steps == [1, 2, 3]


def test_missing_migration_is_a_schema_error(saved: Path, monkeypatch):
    monkeypatch.setattr(artifact_module, "ADAPTER_SCHEMA_VERSION", 3)
    monkeypatch.setattr(artifact_module, "MIGRATIONS", {1: lambda data: data})
    _expect(SchemaVersionError, CalibrationAdapter.from_pretrained, saved,
            match="schema_version 2 and no migration to 3")


def test_the_real_migration_table_is_consistent():
    # every step below the current version exists, none above it
    assert set(artifact_module.MIGRATIONS) == set(range(1, ADAPTER_SCHEMA_VERSION))


def test_the_fit_record_is_typed_and_read_from_the_sections():
    from calm_runtime.formats.fit_record import FitRecord

    cloze = CalibrationAdapter.identity(_identity(), answer_temperature=1.5,
                                        method={"name": "ts", "mode": "cloze", "variant": "sum"})
    assert cloze.fit_record == FitRecord(mode="cloze", cloze_variant="sum",
                                         answer_temperature=1.5, choice_mode="cloze")
    assert cloze.fit_record.binds_variant and cloze.cloze_variant == "sum"
    assert cloze.choice_mode == "cloze"
    letter = CalibrationAdapter.identity(_identity(), temperature=2.0,
                                         method={"name": "ts", "mode": "letter"})
    assert letter.fit_record == FitRecord(mode="letter", choice_mode="letter")
    assert not letter.fit_record.binds_variant
    p_true = CalibrationAdapter.identity(_identity(), method={"name": "ts", "mode": "p_true"})
    assert p_true.fit_record.mode == "p_true" and p_true.choice_mode is None
    assert CalibrationAdapter.identity(_identity()).fit_record == FitRecord()
    # the abstention threshold's mode is the choice mode; unknown values are not recorded
    assert FitRecord.parse({"mode": "cloze", "variant": "median"}, {"mode": "letter"},
                           None) == FitRecord(mode="cloze", choice_mode="letter")
    assert FitRecord.parse(["not", "a", "section"], None, None) == FitRecord()
