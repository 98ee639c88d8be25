"""Regression tests for the artifact loaders: nothing from outside an artifact gets in, and
every malformed input is one typed, one-line CalmError (never a raw traceback).

Findings covered (each test names the one it guards):

1. symlinks in an adapter's ``lora/`` folder (load and save) and in an engine folder;
2. raw tracebacks: deep nesting, symlink loops, NUL characters and over-long names in file
   references, a sparse 100 GB tensors file, truncated or corrupt safetensors headers;
3. manifests looser than docs/formats.md: ``tensors.entries``, ``created_at``,
   ``p_true_template``, ``tokenizer_sha256``, ``base_model.name``, the documented ranges
   of tau / shift / temperatures, the engine's ``validation.greedy_match``;

plus the JSONL reader (deep nesting, huge integers, FIFOs, lone surrogates).

The engine here is synthetic (placeholder graph bytes, a real ``tokenizers`` tokenizer), so
the file needs neither torch nor onnx.
"""

from __future__ import annotations

import json
import os
import re
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import synthetic_engine_manifest, synthetic_genai_config, synthetic_onnx_graph
from safetensors.numpy import save_file

from calm_runtime.data.sets import dataset_hash, read_jsonl
from calm_runtime.errors import ArtifactError, CalmError, DataError
from calm_runtime.files import sha256_file
from calm_runtime.formats.artifact import (
    MANIFEST_NAME,
    TENSORS_NAME,
    CalibrationAdapter,
    ModelIdentity,
)
from calm_runtime.formats.engine import ENGINE_MANIFEST_NAME, EngineManifest
from calm_runtime.inference.tokenization import EngineTokenizer

VOCAB = 8
SECRET = b"-----BEGIN OPENSSH PRIVATE KEY----- not really -----END OPENSSH PRIVATE KEY-----\n"
DEEP = 100_000


# ---------------------------------------------------------------------- helpers
def _expect(exc_type: type[CalmError], fn: Callable, *args, match: str | None = None,
            **kwargs) -> str:
    """Call ``fn``; require exactly ``exc_type`` with a one-line message matching ``match``."""
    with pytest.raises(CalmError) as info:
        fn(*args, **kwargs)
    err = info.value
    assert type(err) is exc_type, f"expected {exc_type.__name__}, got {type(err).__name__}: {err}"
    message = str(err)
    assert "\n" not in message and "\r" not in message, f"not one line: {message!r}"
    if match is not None:
        assert re.search(match, message), f"{match!r} not in {message!r}"
    return message


def _snapshot(root: Path) -> dict[str, object]:
    """Every entry under ``root``: file bytes, symlink targets, folders, other files."""
    tree: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                tree[rel] = ("symlink", os.readlink(path))
            elif path.is_dir():
                tree[rel] = "dir"
            elif path.is_file():
                tree[rel] = path.read_bytes()
            else:
                tree[rel] = "special"
    return tree


def _files_holding(root: Path, needle: bytes) -> list[str]:
    found = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink() and needle in path.read_bytes():
                found.append(str(path.relative_to(root)))
    return found


def _secret(tmp_path: Path) -> Path:
    """A private key outside every artifact (what a malicious link points at)."""
    key = tmp_path / "home" / ".ssh" / "id_rsa"
    key.parent.mkdir(parents=True)
    key.write_bytes(SECRET)
    return key


def _adapter(**overrides) -> CalibrationAdapter:
    fields = {"base_model": ModelIdentity("tiny", VOCAB, "ab" * 32),
              "tau": np.linspace(0.5, 2.0, VOCAB), "shift": np.linspace(-1.0, 1.0, VOCAB),
              "temperature": 1.25, "answer_temperature": 0.75, "kind": "daca"}
    fields.update(overrides)
    return CalibrationAdapter(**fields)


def _lora(folder: Path) -> Path:
    """A peft-shaped LoRA folder (adapter_config.json + a weights file)."""
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    save_file({"lora_A.weight": np.ones((2, 4), np.float32)},
              str(folder / "adapter_model.safetensors"))
    return folder


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A complete adapter with a LoRA folder at ``tmp_path/adapter``."""
    return _adapter(lora_path=_lora(tmp_path / "peft")).save_pretrained(tmp_path / "adapter")


def _edit_manifest(root: Path, edit: Callable[[dict], None]) -> None:
    path = root / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _raw_safetensors(path: Path, header: dict, data: bytes = b"",
                     header_bytes: bytes | None = None) -> None:
    blob = json.dumps(header).encode() if header_bytes is None else header_bytes
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _f32_header(shapes: dict[str, list[int]]) -> tuple[dict, bytes]:
    header, offset, data = {}, 0, b""
    for name, shape in shapes.items():
        size = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        data += np.ones(int(np.prod(shape)), np.float32).tobytes()
        offset += size
    return header, data


def _tokenizer_json(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "A": 4, "B": 5, "hello": 6}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))


CHAT_TEMPLATE = "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{% endfor %}"


def _engine(root: Path) -> tuple[Path, dict]:
    """A synthetic engine folder (placeholder graph, real tokenizer) and its manifest dict."""
    root.mkdir(parents=True)
    (root / "model.onnx").write_bytes(synthetic_onnx_graph("model.onnx.data"))
    (root / "model.onnx.data").write_bytes(b"weights" * 10)
    _tokenizer_json(root / "tokenizer.json")
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))
    (root / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (root / "genai_config.json").write_text(synthetic_genai_config())
    data = synthetic_engine_manifest(root, model_files=("model.onnx", "model.onnx.data"))
    _write_engine_manifest(root, data)
    return root, data


def _write_engine_manifest(root: Path, data: dict) -> None:
    (root / ENGINE_MANIFEST_NAME).write_text(json.dumps(data))


def _load_engine(root: Path) -> tuple[EngineManifest, EngineTokenizer]:
    manifest = EngineManifest.load(root)
    return manifest, EngineTokenizer(manifest)


def test_the_synthetic_engine_loads(tmp_path: Path):
    manifest, tokenizer = _load_engine(_engine(tmp_path / "engine")[0])
    assert manifest.num_layers == 1 and tokenizer.has_chat_template
    assert tokenizer.render_chat("hello") == "<s>hello"


# ====================================================================== 1. symlinks
def test_lora_link_out_of_the_adapter_is_refused_on_load(tmp_path: Path, saved: Path):
    (saved / "lora" / "notes.txt").symlink_to(_secret(tmp_path))
    before = _snapshot(tmp_path)
    _expect(ArtifactError, CalibrationAdapter.from_pretrained, saved,
            match=r"LoRA folder 'lora' holds 'notes\.txt', a symlink to .*id_rsa.* outside")
    assert _snapshot(tmp_path) == before


def test_lora_link_nested_in_a_subfolder_is_refused_on_load(tmp_path: Path, saved: Path):
    (saved / "lora" / "checkpoint" / "deep").mkdir(parents=True)
    (saved / "lora" / "checkpoint" / "deep" / "key").symlink_to(_secret(tmp_path))
    _expect(ArtifactError, CalibrationAdapter.from_pretrained, saved,
            match=r"'checkpoint/deep/key', a symlink to .* outside")


def test_save_never_copies_a_file_from_outside_the_lora_folder(tmp_path: Path):
    # a shared peft folder whose notes.txt points at the user's key: before the fix the
    # re-saved adapter held the key as a regular file
    peft = _lora(tmp_path / "shared_peft")
    (peft / "notes.txt").symlink_to(_secret(tmp_path))
    before = _snapshot(tmp_path)
    _expect(ArtifactError, _adapter(lora_path=peft).save_pretrained, tmp_path / "new",
            match=r"holds 'notes\.txt', a symlink to .*outside the folder")
    assert _snapshot(tmp_path) == before, "a refused save wrote something"
    assert not (tmp_path / "new").exists()


def test_resave_of_a_loaded_adapter_whose_lora_gained_a_link_is_refused(tmp_path: Path,
                                                                         saved: Path):
    # `calm fit daca --adapter it --out new` loads, fits, then re-saves the LoRA: a link
    # that appears between the load and the save must not be followed either
    loaded = CalibrationAdapter.from_pretrained(saved)
    (saved / "lora" / "notes.txt").symlink_to(_secret(tmp_path))
    _expect(ArtifactError, loaded.save_pretrained, tmp_path / "new", match="outside the folder")
    assert not (tmp_path / "new").exists()
    assert _files_holding(tmp_path, SECRET) == ["home/.ssh/id_rsa"]


def test_the_copy_checks_each_file_again(tmp_path: Path, monkeypatch):
    # the tree check before the copy is skipped (as if a link were swapped in after it):
    # the copy itself still refuses to read a file outside the folder
    peft = _lora(tmp_path / "shared_peft")
    (peft / "notes.txt").symlink_to(_secret(tmp_path))
    monkeypatch.setattr("calm_runtime.formats.artifact.check_tree", lambda *a, **k: None,
                        raising=False)
    _expect(ArtifactError, _adapter(lora_path=peft).save_pretrained, tmp_path / "new",
            match="outside the folder")
    assert _files_holding(tmp_path, SECRET) == ["home/.ssh/id_rsa"]
    assert not (tmp_path / "new").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".new.")]


def test_links_inside_the_lora_folder_are_copied_as_their_files(tmp_path: Path):
    peft = _lora(tmp_path / "peft")
    (peft / "alias.safetensors").symlink_to("adapter_model.safetensors")
    target = _adapter(lora_path=peft).save_pretrained(tmp_path / "out")
    copied = target / "lora" / "alias.safetensors"
    assert copied.is_file() and not copied.is_symlink()
    assert copied.read_bytes() == (peft / "adapter_model.safetensors").read_bytes()
    assert CalibrationAdapter.from_pretrained(target).lora_path == target / "lora"


def _dangling(lora: Path, tmp_path: Path) -> None:
    (lora / "gone.bin").symlink_to(lora / "no-such-file")


def _loop(lora: Path, tmp_path: Path) -> None:
    (lora / "a").symlink_to("b")
    (lora / "b").symlink_to("a")


def _folder_link(lora: Path, tmp_path: Path) -> None:
    # a link to a folder inside would make the copy recurse (here: into itself, forever)
    (lora / "again").symlink_to(".", target_is_directory=True)


def _fifo(lora: Path, tmp_path: Path) -> None:
    os.mkfifo(lora / "pipe")


def _link_to_adapter_file(lora: Path, tmp_path: Path) -> None:
    # inside the adapter but outside the LoRA folder: not a peft file, refused as well
    (lora / "tensors").symlink_to(lora.parent / TENSORS_NAME)


BAD_TREES = {
    "dangling": (_dangling, "dangling symlink"),
    "loop": (_loop, "symlink loop|cannot be resolved"),
    "link_to_folder": (_folder_link, "symlink to a folder"),
    "fifo": (_fifo, "not a regular file"),
    "link_out_of_lora": (_link_to_adapter_file, "outside the folder"),
}


@pytest.mark.parametrize("case", sorted(BAD_TREES))
def test_bad_lora_trees_are_refused_on_load(tmp_path: Path, saved: Path, case):
    damage, match = BAD_TREES[case]
    damage(saved / "lora", tmp_path)
    _expect(ArtifactError, CalibrationAdapter.from_pretrained, saved, match=match)


@pytest.mark.parametrize("case", sorted(BAD_TREES))
def test_bad_lora_trees_are_refused_on_save_and_nothing_is_written(tmp_path: Path, case):
    damage, match = BAD_TREES[case]
    peft = _lora(tmp_path / "adapter_like" / "lora")
    (tmp_path / "adapter_like" / TENSORS_NAME).write_bytes(b"x")
    damage(peft, tmp_path)
    before = _snapshot(tmp_path)
    _expect(ArtifactError, _adapter(lora_path=peft).save_pretrained, tmp_path / "new",
            match=match)
    assert _snapshot(tmp_path) == before


ENGINE_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                "model.onnx", "model.onnx.data", "genai_config.json"]


@pytest.mark.parametrize("name", ENGINE_FILES)
def test_engine_files_linked_out_of_the_folder_are_refused(tmp_path: Path, name):
    # the link's target has the right bytes (and so the right sha256): the place is refused
    root, _ = _engine(tmp_path / "engine")
    outside = tmp_path / f"outside-{name}"
    os.replace(root / name, outside)
    (root / name).symlink_to(outside)
    _expect(ArtifactError, _load_engine, root, match=r"resolves outside the artifact directory")


def test_engine_file_linked_inside_the_folder_is_fine(tmp_path: Path):
    root, _ = _engine(tmp_path / "engine")
    os.replace(root / "tokenizer_config.json", root / "real_config.json")
    (root / "tokenizer_config.json").symlink_to("real_config.json")
    assert _load_engine(root)[1].has_chat_template


# ====================================================================== 2. one-line errors
def _deep(depth: int = DEEP) -> str:
    return "[" * depth + "]" * depth


def test_deeply_nested_adapter_manifest(saved: Path):
    (saved / MANIFEST_NAME).write_text('{"schema_version": 1, "metrics": ' + _deep() + "}")
    _expect(ArtifactError, CalibrationAdapter.from_pretrained, saved,
            match=r"not valid JSON \(nested deeper than 100 levels\)")


def test_nesting_that_json_can_parse_but_is_too_deep_is_refused(saved: Path):
    # 500 levels parse, but a re-save (json.dumps) or an error message (repr) could recurse
    _edit_manifest(saved, lambda m: m.update(metrics={"curve": json.loads(_deep(500))}))
    _expect(ArtifactError, CalibrationAdapter.from_pretrained, saved, match="nested deeper")


def test_deeply_nested_engine_manifest(tmp_path: Path):
    root, _ = _engine(tmp_path / "engine")
    (root / ENGINE_MANIFEST_NAME).write_text('{"schema_version": 1, "export": ' + _deep() + "}")
    _expect(ArtifactError, EngineManifest.load, root, match="nested deeper than 100")


def test_deeply_nested_tokenizer_config(tmp_path: Path):
    root, data = _engine(tmp_path / "engine")
    (root / "tokenizer_config.json").write_text('{"bos_token": ' + _deep() + "}")
    data["tokenizer"]["files"]["tokenizer_config.json"] = sha256_file(
        root / "tokenizer_config.json")
    _write_engine_manifest(root, data)
    _expect(ArtifactError, _load_engine, root, match=r"tokenizer_config\.json is not valid JSON")


@pytest.mark.parametrize("where", ["tensors.file", "lora", "engine"])
@pytest.mark.parametrize("reference", ["loop", "a\x00b", "n" * 300, "sub/" + "m" * 256],
                         ids=["symlink_loop", "nul", "name_300", "nested_name_256"])
def test_bad_file_references_are_one_line_errors(tmp_path: Path, saved: Path, where,
                                                 reference):
    if where == "engine":
        root, data = _engine(tmp_path / "engine")
        data["model"]["files"][reference] = "0" * 64
        _write_engine_manifest(root, data)
        load: Callable = EngineManifest.load
    else:
        root, load = saved, CalibrationAdapter.from_pretrained
        if where == "lora":
            _edit_manifest(root, lambda m: m.update(lora=reference))
        else:
            _edit_manifest(root, lambda m: m["tensors"].update(file=reference))
    (root / "loop").symlink_to("loop2")
    (root / "loop2").symlink_to("loop")
    message = _expect(ArtifactError, load, root,
                      match="symlink loop|NUL character|longer than the 255")
    assert len(message) < 1000


def test_manifest_that_is_a_symlink_loop_or_links_out(tmp_path: Path, saved: Path):
    (saved / MANIFEST_NAME).rename(tmp_path / "outside.json")
    (saved / MANIFEST_NAME).symlink_to(MANIFEST_NAME)
    _expect(ArtifactError, CalibrationAdapter.from_pretrained, saved, match="symlink loop")
    (saved / MANIFEST_NAME).unlink()
    (saved / MANIFEST_NAME).symlink_to(tmp_path / "outside.json")  # a valid manifest, outside
    _expect(ArtifactError, CalibrationAdapter.from_pretrained, saved,
            match="resolves outside the artifact directory")
    root, _ = _engine(tmp_path / "engine")
    (root / ENGINE_MANIFEST_NAME).rename(tmp_path / "engine.json")
    (root / ENGINE_MANIFEST_NAME).symlink_to(tmp_path / "engine.json")
    _expect(ArtifactError, EngineManifest.load, root, match="resolves outside")


def _sparse_tensors(path: Path, tau_elements: int) -> None:
    """A 100 GB sparse file whose header describes its bytes exactly."""
    shapes = {"tau": [tau_elements], "shift": [VOCAB], "temperature": []}
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(blob)) + blob)
        handle.truncate(8 + len(blob) + offset)  # sparse: no disk blocks, no data read


def test_sparse_100gb_tensors_file_is_refused_before_any_data_is_read(saved: Path):
    _sparse_tensors(saved / TENSORS_NAME, 25_000_000_000)
    try:
        assert (saved / TENSORS_NAME).stat().st_size > 100_000_000_000
        start = time.perf_counter()
        _expect(ArtifactError, CalibrationAdapter.from_pretrained, saved,
                match=r"calibration\.safetensors.* has 1000000\d+ bytes, more than the")
        assert time.perf_counter() - start < 5
    finally:
        (saved / TENSORS_NAME).unlink()


def test_sparse_tensors_file_with_a_matching_huge_vocab_is_refused(saved: Path):
    # the manifest agrees with the file, so only the vocabulary bound stops the read
    _edit_manifest(saved, lambda m: (m["base_model"].update(vocab_size=25_000_000_000),
                                     m["tensors"].pop("entries")))
    _sparse_tensors(saved / TENSORS_NAME, 25_000_000_000)
    try:
        _expect(ArtifactError, CalibrationAdapter.from_pretrained, saved,
                match="vocab_size must be a positive integer of at most 16777216")
    finally:
        (saved / TENSORS_NAME).unlink()


def _header_past_the_end(path: Path) -> None:
    header, data = _f32_header({"tau": [VOCAB], "shift": [VOCAB], "temperature": []})
    header["temperature"]["data_offsets"] = [len(data) - 4, len(data) + 4000]
    _raw_safetensors(path, header, data)


def _header_length_beyond_file(path: Path) -> None:
    path.write_bytes(struct.pack("<Q", 1 << 62) + b"{}")


def _header_not_json(path: Path) -> None:
    _raw_safetensors(path, {}, b"", header_bytes=b'{"tau": [' + b"\xff" * 10)


def _header_gap(path: Path) -> None:
    header, data = _f32_header({"tau": [VOCAB], "shift": [VOCAB], "temperature": []})
    header["shift"]["data_offsets"] = [header["shift"]["data_offsets"][0] + 4,
                                       header["shift"]["data_offsets"][1] + 4]
    header["temperature"]["data_offsets"] = [len(data), len(data) + 4]
    _raw_safetensors(path, header, data + b"\0" * 4)


def _header_huge_shape(path: Path) -> None:
    header, data = _f32_header({"tau": [VOCAB], "shift": [VOCAB], "temperature": []})
    header["tau"]["shape"] = [2 ** 62, 2 ** 62]
    _raw_safetensors(path, header, data)


def _header_negative_offset(path: Path) -> None:
    header, data = _f32_header({"tau": [VOCAB], "shift": [VOCAB], "temperature": []})
    header["tau"]["data_offsets"] = [-4, 28]
    _raw_safetensors(path, header, data)


def _header_deep(path: Path) -> None:
    _raw_safetensors(path, {}, b"", header_bytes=('{"tau": ' + _deep(50_000) + "}").encode())


CORRUPT_HEADERS = {
    "offsets_past_the_end": _header_past_the_end,
    "header_length_beyond_file": _header_length_beyond_file,
    "header_not_utf8_json": _header_not_json,
    "gap_between_tensors": _header_gap,
    "shape_overflowing_int64": _header_huge_shape,
    "negative_offset": _header_negative_offset,
    "header_nested_deep": _header_deep,
    "seven_bytes": lambda path: path.write_bytes(b"\x10" * 7),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_HEADERS))
def test_corrupt_safetensors_headers_are_one_line_errors(saved: Path, case):
    CORRUPT_HEADERS[case](saved / TENSORS_NAME)
    _expect(ArtifactError, CalibrationAdapter.from_pretrained, saved,
            match="not a readable safetensors file|has .* bytes, more than")


# ====================================================================== 3. strict manifests
def _entries(edit: Callable[[dict], None]) -> Callable[[dict], None]:
    return lambda m: edit(m["tensors"]["entries"])


BAD_ENTRIES = {
    "extra_name": _entries(lambda e: e.update(log_tau={"shape": [VOCAB], "dtype": "float32"})),
    "missing_name": _entries(lambda e: e.pop("answer_temperature")),
    "wrong_shape": _entries(lambda e: e["tau"].update(shape=[VOCAB - 1])),
    "float_shape": _entries(lambda e: e["tau"].update(shape=[float(VOCAB)])),
    "bool_shape": _entries(lambda e: e["temperature"].update(shape=[True])),
    "wrong_dtype": _entries(lambda e: e["shift"].update(dtype="float16")),
    "extra_key": _entries(lambda e: e["shift"].update(sha256="00")),
    "not_an_object": lambda m: m["tensors"].update(entries=["tau", "shift"]),
    "entry_not_an_object": _entries(lambda e: e.update(tau="float32[8]")),
}


@pytest.mark.parametrize("case", sorted(BAD_ENTRIES))
def test_tensors_entries_must_match_the_file(saved: Path, case):
    _edit_manifest(saved, BAD_ENTRIES[case])
    _expect(ArtifactError, CalibrationAdapter.from_pretrained, saved, match="tensors.entries")


def test_tensors_entries_may_be_left_out(saved: Path):
    _edit_manifest(saved, lambda m: m["tensors"].pop("entries"))
    assert CalibrationAdapter.from_pretrained(saved).temperature == 1.25


BAD_FIELDS = {
    "created_at_number": (lambda m: m.update(created_at=1767225600), "created_at"),
    "created_at_words": (lambda m: m.update(created_at="yesterday"), "created_at"),
    "created_at_month_13": (lambda m: m.update(created_at="2026-13-01T00:00:00+00:00"),
                            "created_at"),
    "created_at_list": (lambda m: m.update(created_at=["2026"]), "created_at"),
    "p_true_number": (lambda m: m.update(p_true_template=5), "p_true_template"),
    "p_true_unknown_name": (lambda m: m.update(p_true_template="no-such-template"),
                            "unknown template name"),
    "p_true_list": (lambda m: m.update(p_true_template=["kadavath"]), "p_true_template"),
    "p_true_no_fields": (lambda m: m.update(p_true_template={
        "template": "Is it true?", "true_token": " A", "false_token": " B"}),
        r"must contain \{question\} and \{answer\}"),
    "p_true_other_field": (lambda m: m.update(p_true_template={
        "template": "{question} {answer} {secret.__class__}", "true_token": " A",
        "false_token": " B"}), "no other fields"),
    "p_true_token_number": (lambda m: m.update(p_true_template={
        "template": "{question} {answer}", "true_token": 1, "false_token": " B"}),
        "true_token must be a string"),
    "p_true_unknown_key": (lambda m: m.update(p_true_template={
        "template": "{question} {answer}", "true_token": " A", "false_token": " B",
        "colour": "red"}), r"unknown key\(s\) \['colour'\]"),
    "tokenizer_sha256_number": (lambda m: m["base_model"].update(tokenizer_sha256=7),
                                "tokenizer_sha256 must be a sha256"),
    "tokenizer_sha256_short": (lambda m: m["base_model"].update(tokenizer_sha256="abc"),
                               "tokenizer_sha256 must be a sha256"),
    "tokenizer_sha256_upper": (lambda m: m["base_model"].update(tokenizer_sha256="AB" * 32),
                               "tokenizer_sha256 must be a sha256"),
    "name_number": (lambda m: m["base_model"].update(name=5), "name must be a non-empty string"),
    "name_list": (lambda m: m["base_model"].update(name=["tiny"]), "name must be a non-empty"),
    "name_empty": (lambda m: m["base_model"].update(name=""), "name must be a non-empty"),
    "vocab_huge": (lambda m: m["base_model"].update(vocab_size=10 ** 30), "vocab_size"),
    "infinity_literal": (lambda m: m["metrics"].update(big=float("inf")), "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_manifest_fields_are_checked_as_documented(saved: Path, case):
    edit, match = BAD_FIELDS[case]
    _edit_manifest(saved, edit)
    _expect(ArtifactError, CalibrationAdapter.from_pretrained, saved, match=match)


def test_overflowing_number_literal_is_refused(saved: Path):
    # 1e999 is valid JSON that Python reads as inf without asking parse_constant
    text = (saved / MANIFEST_NAME).read_text().replace('"metrics": {}', '"metrics": {"x": 1e999}')
    (saved / MANIFEST_NAME).write_text(text)
    _expect(ArtifactError, CalibrationAdapter.from_pretrained, saved, match="is not finite")


@pytest.mark.parametrize("value", ["kadavath", "yes-no", {
    "name": "mine", "template": "Q: {question}\nA: {answer}\nTrue? {{yes}}",
    "true_token": " Yes", "false_token": " No", "description": "braces escaped"}])
def test_valid_p_true_templates_load(tmp_path: Path, value):
    target = _adapter(p_true_template=value).save_pretrained(tmp_path / "a")
    assert CalibrationAdapter.from_pretrained(target).p_true_template == value


@pytest.mark.parametrize("created_at", ["2026-12-01T00:19:31+00:00", "2026-12-01T00:19:31Z",
                                        "2026-12-01T00:19:31.123456-05:30"])
def test_valid_created_at_load(tmp_path: Path, created_at):
    target = _adapter(created_at=created_at).save_pretrained(tmp_path / "a")
    assert CalibrationAdapter.from_pretrained(target).created_at == created_at


def test_bad_fields_are_refused_at_construction():
    _expect(ArtifactError, _adapter, created_at="yesterday", match="created_at")
    _expect(ArtifactError, _adapter, p_true_template={"template": "x"}, match="p_true_template")
    _expect(ArtifactError, _adapter, base_model=ModelIdentity(5, VOCAB), match="name")
    _expect(ArtifactError, _adapter, base_model=ModelIdentity("m", VOCAB, "xyz"),
            match="tokenizer_sha256")
    _expect(ArtifactError, _adapter, tau=["a"] * VOCAB, match="tau must be an array of numbers")


def _set_at(array: np.ndarray, index: int, value: float) -> np.ndarray:
    array = np.array(array, dtype=np.float64)
    array[index] = value
    return array


OUT_OF_RANGE = {
    "tau_tiny": ({"tau": _set_at(np.ones(VOCAB), 3, 1e-45)},
                 r"tau has 1 entries outside the allowed range \[0\.0001, 10000\] \(first at "
                 r"token id 3: tau\[3\] = 1\.4013e-45\)"),
    "tau_huge": ({"tau": _set_at(np.ones(VOCAB), 6, 2e4)}, r"tau\[6\] = 20000"),
    "shift_huge": ({"shift": _set_at(np.zeros(VOCAB), 5, -3e4)},
                   r"shift has 1 entries outside the allowed range \[-10000, 10000\] .*"
                   r"shift\[5\] = -30000"),
    "temperature_tiny": ({"temperature": 1e-45},
                         r"temperature is 1(\.4013)?e-45, outside the allowed range \[0\.0001, "
                         r"10000\]"),
    "temperature_huge": ({"temperature": 1e5}, r"temperature is 100000, outside"),
    "answer_temperature_tiny": ({"answer_temperature": 1e-6},
                                r"answer_temperature is (1e-06|9\.99\d*e-07), outside"),
}


@pytest.mark.parametrize("case", sorted(OUT_OF_RANGE))
def test_out_of_range_values_are_refused_at_construction_save_and_load(tmp_path: Path, case):
    fields, match = OUT_OF_RANGE[case]
    _expect(ArtifactError, _adapter, match=match, **fields)

    adapter = _adapter()
    for name, value in fields.items():  # edited after construction: the save refuses
        setattr(adapter, name, value)
    before = _snapshot(tmp_path)
    _expect(ArtifactError, adapter.save_pretrained, tmp_path / "out", match=match)
    assert _snapshot(tmp_path) == before

    target = _adapter().save_pretrained(tmp_path / "ok")  # written by another tool
    tensors = {k: np.asarray(v, np.float32) for k, v in
               {"tau": _adapter().tau, "shift": _adapter().shift, "temperature": 1.25,
                "answer_temperature": 0.75, **fields}.items()}
    (target / TENSORS_NAME).unlink()
    save_file(tensors, str(target / TENSORS_NAME))
    _expect(ArtifactError, CalibrationAdapter.from_pretrained, target, match=match)


def test_values_at_the_bounds_round_trip_and_calibrate_finitely(tmp_path: Path):
    tau = np.array([1e-4, 1e4, 1.0, 1e-4, 1e4, 2.0, 0.5, 1.0])
    shift = np.array([1e4, -1e4, 0.0, -1e4, 1e4, 0.0, 1.0, -1.0])
    for temperature in (1e-4, 1e4):
        adapter = _adapter(tau=tau, shift=shift, temperature=temperature,
                           answer_temperature=temperature)
        loaded = CalibrationAdapter.from_pretrained(
            adapter.save_pretrained(tmp_path / f"t{temperature:g}"))
        assert loaded.temperature == np.float32(temperature)
        logits = np.random.default_rng(0).uniform(-100, 100, (4, VOCAB)).astype(np.float32)
        assert np.isfinite(loaded.calibrate(logits)).all()


def test_engine_greedy_match_false_is_refused(tmp_path: Path):
    root, data = _engine(tmp_path / "engine")
    for value in (False, "true", 1, None):
        data["validation"]["greedy_match"] = value
        _write_engine_manifest(root, data)
        _expect(ArtifactError, EngineManifest.load, root, match="greedy_match is .*not true")


ENGINE_FIELDS = {
    "temperature_tiny": (lambda d: d["calibration"].update(temperature=1e-45), "outside"),
    "answer_temperature_huge": (lambda d: d["calibration"].update(answer_temperature=1e6),
                                "outside"),
    "tau_min_above_max": (lambda d: d["calibration"].update(tau_min=3.0), "above tau_max"),
    "created_at_words": (lambda d: d.update(created_at="today"), "created_at"),
    "model_file_list": (lambda d: d["model"].update(file=["model.onnx"]), "not listed"),
    "chat_template_object": (lambda d: d["tokenizer"].update(chat_template={}), "not listed"),
    "p_true_format_field": (lambda d: d["p_true_template"].update(
        template="{question} {answer} {0}"), "no other fields"),
    "p_true_token_number": (lambda d: d["p_true_template"].update(true_token=7),
                            "true_token must be a string"),
    "genai_config_string": (lambda d: d["export"].update(genai_config="genai_config.json"),
                            "genai_config must be"),
    "genai_config_file_null": (lambda d: d["export"]["genai_config"].update(file=None),
                               "genai_config.file"),
    "path_name_number": (lambda d: d["source"].update(adapter={
        "kind": "x", "path_name": 5, "tensors_sha256": None, "manifest_sha256": None}),
        "path_name"),
}


@pytest.mark.parametrize("case", sorted(ENGINE_FIELDS))
def test_engine_manifest_fields_are_checked(tmp_path: Path, case):
    edit, match = ENGINE_FIELDS[case]
    root, data = _engine(tmp_path / "engine")
    edit(data)
    _write_engine_manifest(root, data)
    _expect(ArtifactError, EngineManifest.load, root, match=match)


def test_engine_chat_template_that_is_not_utf8_or_does_not_compile(tmp_path: Path):
    root, data = _engine(tmp_path / "engine")
    (root / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    data["tokenizer"]["files"]["chat_template.jinja"] = sha256_file(root / "chat_template.jinja")
    _write_engine_manifest(root, data)
    _expect(ArtifactError, _load_engine, root, match="not UTF-8")
    (root / "chat_template.jinja").write_text("{{ (" * 5000)
    data["tokenizer"]["files"]["chat_template.jinja"] = sha256_file(root / "chat_template.jinja")
    _write_engine_manifest(root, data)
    _expect(ArtifactError, _load_engine, root, match="does not compile")


def test_engine_named_chat_templates_with_odd_names(tmp_path: Path):
    root, data = _engine(tmp_path / "engine")
    templates = [{"name": ["not", "hashable"], "template": "x"},
                 {"name": "default", "template": "{{ 1 }}"}]
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    data["tokenizer"].update(chat_template=None)
    data["tokenizer"]["files"]["tokenizer_config.json"] = sha256_file(
        root / "tokenizer_config.json")
    _write_engine_manifest(root, data)
    assert _load_engine(root)[1].render_chat("hi") == "1"


# ====================================================================== JSONL
def _jsonl(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return path


@pytest.mark.parametrize("line, match", [
    ('{"question": "q", "choices": ' + _deep() + "}", r":1: invalid JSON \(nested too deeply"),
    ('{"question": "q", "choices": ["a", "b"], "answer": ' + "7" * 5000 + "}",
     r":1: invalid JSON \(Exceeds the limit"),
    ('{"question": "q\\ud800", "choices": ["a", "b"]}', r":1: 'question' holds an unpaired "
     r"surrogate \('\\ud800' at character 1\)"),
    ('{"question": "q", "choices": ["a", "\\udfff b"]}', r"choice 1 holds an unpaired surrogate"),
    ('{"question": "q", "answers": ["a"], "id": "\\ud83d"}', r"'id' holds an unpaired"),
    ('{"question": "q", "choices": ' + "[" * 500 + "]" * 500 + "}",
     r"'choices' has 1 entries, fewer than 2"),
])
def test_jsonl_lines_that_used_to_raise_raw_errors(tmp_path: Path, line, match):
    message = _expect(DataError, read_jsonl, _jsonl(tmp_path, line + "\n"), match=match)
    assert len(message) < 600


def test_jsonl_records_that_read_can_be_hashed(tmp_path: Path):
    path = _jsonl(tmp_path, '{"question": "\\ud83d\\ude00 ok", "choices": ["a", "b"]}\n')
    assert len(dataset_hash(read_jsonl(path))) == 64


def test_jsonl_fifo_is_refused_without_blocking(tmp_path: Path):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            read_jsonl(fifo)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome.append(exc)

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    worker.join(timeout=10)
    if worker.is_alive():  # unblock the reader so the test process can end
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        worker.join(timeout=10)
        pytest.fail("read_jsonl blocked on a FIFO")
    assert isinstance(outcome[0], DataError) and "not a regular file" in str(outcome[0])


@pytest.mark.parametrize("path", ["bad\x00name.jsonl", "n" * 300 + ".jsonl"])
def test_jsonl_unopenable_paths(tmp_path: Path, path):
    _expect(DataError, read_jsonl, tmp_path / path, match="cannot be read|no such file")


def test_jsonl_folder_is_refused(tmp_path: Path):
    _expect(DataError, read_jsonl, tmp_path, match="not a regular file|cannot be read")
