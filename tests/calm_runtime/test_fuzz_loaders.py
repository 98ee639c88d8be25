"""Property tests (fuzzing) of the loaders that read what other people send you.

The property, for every input: loading either succeeds, and the loaded object is
consistent (it validates, saves and reloads to the same thing), or it raises a
:class:`~calm_runtime.errors.CalmError` with a one-line message. Never another exception,
never a hang (each example runs under an alarm), and nothing is written outside the test's
temporary folder (the loaders write nothing at all).

Inputs: mutated manifests (type swaps, deletions, unknown keys, huge numbers, NaN strings,
raw NaN/1e999 literals, deep nesting), mutated safetensors files (random bytes, header
edits, wrong lengths, offsets past the end, flipped bytes), file trees with symlinks
(inside, outside, loops, dangling, folders, FIFOs), a synthetic engine folder (manifest and
tokenizer_config.json, no ONNX session) and JSONL files.

CI-safe: ``derandomize=True`` (a fixed seed), bounded ``max_examples``, no example database.
The whole file runs in well under a minute on two cores.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import signal
import struct
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import synthetic_engine_manifest, synthetic_genai_config, synthetic_onnx_graph
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from calm_runtime.data.sets import dataset_hash, read_jsonl, write_jsonl
from calm_runtime.errors import CalmError
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
SECRET = b"-----BEGIN FUZZ SECRET----- do not copy me -----END FUZZ SECRET-----\n"
EXAMPLE_SECONDS = 30  # an example that runs longer than this is a hang
#: how many examples each property ran (reported by test_zz_case_count)
CASES: Counter = Counter()


def _settings(max_examples: int):
    return settings(max_examples=max_examples, derandomize=True, deadline=None, database=None)


# ---------------------------------------------------------------------- the property
class _Alarm:
    active = False
    fired = False


@contextlib.contextmanager
def _no_hang(seconds: int = EXAMPLE_SECONDS):
    """Fail a call that blocks or loops: SIGALRM interrupts it (a FIFO open, too). A nested
    call runs under the outer alarm."""
    if _Alarm.active:
        yield
        return

    def fire(signum, frame):
        _Alarm.fired = True
        raise TimeoutError(f"an example ran longer than {seconds} s")

    _Alarm.active, _Alarm.fired = True, False
    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        _Alarm.active = False
    assert not _Alarm.fired, "an example hung (its alarm fired and was swallowed)"


def _outcome(fn, *args, **kwargs):
    """``(result, None)`` or ``(None, error)`` for a CalmError with a one-line message."""
    with _no_hang():
        try:
            return fn(*args, **kwargs), None
        except CalmError as exc:
            message = str(exc)
            assert message, f"{type(exc).__name__} with an empty message"
            assert "\n" not in message and "\r" not in message, f"not one line: {message!r}"
            assert len(message) < 2000, f"message of {len(message)} characters"
            return None, exc


def _listing(root: Path) -> list[tuple[str, int, str]]:
    """Names, sizes and kinds of everything under ``root`` (not following links)."""
    rows = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            info = os.lstat(path)
            kind = ("link:" + os.readlink(path)) if path.is_symlink() else oct(info.st_mode)
            rows.append((str(path.relative_to(root)), info.st_size, kind))
    return sorted(rows)


@pytest.fixture(scope="module")
def box(tmp_path_factory) -> Path:
    """The module's folder; every example works in a fresh folder inside it."""
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module", autouse=True)
def _work_in_the_box(box: Path):
    """Run the module inside its temporary folder, so that a relative write would land
    where :func:`_example` sees it (and never in the checkout)."""
    previous = os.getcwd()
    os.chdir(box)
    try:
        yield
    finally:
        os.chdir(previous)


def _box_listing(box: Path) -> list[str]:
    return sorted(n for n in os.listdir(box) if n != ".hypothesis")  # hypothesis' own cache


@contextlib.contextmanager
def _example(box: Path, template: Path | None = None):
    """A fresh folder for one example (a copy of ``template``), removed afterwards; checks
    that nothing was added next to it."""
    folder = Path(tempfile.mkdtemp(dir=box))
    before = _box_listing(box)
    if template is not None:
        shutil.copytree(template, folder / template.name, symlinks=True)
    try:
        yield folder
        assert _box_listing(box) == before, "something was written outside the example"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------- JSON mutations
class Raw:
    """A JSON text inserted verbatim (deep nesting, NaN, 1e999, 5000-digit integers)."""

    def __init__(self, text: str) -> None:
        self.text = text


def _nest(depth: int) -> str:
    return "[" * depth + "]" * depth


RAW_TEXTS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e400", "1e-400", "7" * 5000,
             "-0.0", _nest(99), _nest(100), _nest(101), _nest(990), _nest(5000),
             _nest(100_000), '{"a":' * 2000 + "1" + "}" * 2000]
ODD_STRINGS = ["NaN", "nan", "Infinity", "-inf", "", " ", "../x", "../../etc/passwd",
               "/etc/passwd", "a\x00b", "n" * 300, "sub/" + "m" * 256, "lora", ".", "..",
               TENSORS_NAME, MANIFEST_NAME, "model.onnx", "tokenizer.json", "kadavath",
               "yes-no", "{question} {answer}", "{question}", "{0} {question} {answer}",
               "2026-01-01T00:00:00Z", "2026-02-30T00:00:00+00:00", "0" * 64, "AB" * 32,
               "float32", "F32", "\ud800", "line\nbreak", "\u202e", "é" * 40]
ODD_NUMBERS = [0, -1, 1, 2, 8, 9, 300, 2 ** 24, 2 ** 24 + 1, 2 ** 31, 2 ** 63, 2 ** 64,
               10 ** 30, -(10 ** 30), 1e-45, 1e-5, 1e-4, 9.99e-5, 1e4, 10000.5, 1e308,
               -1e308, 0.5, 1.25, -0.0, 1.0, 2.0]

_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(ODD_NUMBERS),
    st.text(max_size=12), st.sampled_from(ODD_STRINGS),
    st.sampled_from(RAW_TEXTS).map(Raw),
)
json_values = st.recursive(
    _leaves, lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=6) | st.sampled_from(ODD_STRINGS), inner, max_size=3),
    max_leaves=8)
_index = st.integers(0, 10 ** 6)
mutations = st.lists(st.one_of(
    st.tuples(st.just("set"), _index, json_values),
    st.tuples(st.just("delete"), _index),
    st.tuples(st.just("insert"), _index, st.text(min_size=1, max_size=8), json_values),
    st.tuples(st.just("swap_type"), _index),
), min_size=1, max_size=4)
raw_edits = st.one_of(st.none(), st.tuples(st.just("truncate"), _index),
                      st.tuples(st.just("flip"), _index, st.integers(0, 255)))


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _paths(item, prefix + (i,))
    return found


def _swap(value: Any) -> Any:
    """The same content as another JSON type (what a hand edit or another tool does)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return {str(i): v for i, v in enumerate(value)}
    if isinstance(value, dict):
        return list(value.values())
    return False


def _mutate(doc: Any, ops: list) -> Any:
    doc = copy.deepcopy(doc)
    for op in ops:
        paths = _paths(doc)
        path = paths[op[1] % len(paths)]
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        if op[0] == "insert":
            containers = [p for p in paths if isinstance(_get(doc, p), dict)]
            if containers:
                _get(doc, containers[op[1] % len(containers)])[op[2]] = op[3]
            continue
        if not path:  # the root itself
            if op[0] == "set":
                doc = op[2]
            elif op[0] == "swap_type":
                doc = _swap(doc)
            continue
        if op[0] == "set":
            parent[path[-1]] = op[2]
        elif op[0] == "swap_type":
            parent[path[-1]] = _swap(parent[path[-1]])
        elif op[0] == "delete":
            del parent[path[-1]]
    return doc


def _get(doc: Any, path: tuple) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def _dumps(doc: Any, edit=None) -> bytes:
    """JSON bytes with :class:`Raw` texts inserted and an optional raw edit."""
    raws: list[str] = []

    def default(value):
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"\x01RAW{len(raws) - 1}\x01"
        raise TypeError(type(value).__name__)

    text = json.dumps(doc, default=default, allow_nan=True)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x01RAW{i}\x01"), raw)
    data = text.encode("utf-8", "surrogatepass")
    if edit is not None and data:
        if edit[0] == "truncate":
            data = data[:edit[1] % len(data)]
        else:
            position = edit[1] % len(data)
            data = data[:position] + bytes([edit[2]]) + data[position + 1:]
    return data


# ---------------------------------------------------------------------- adapters
def _lora(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    save_file({"lora_A.weight": np.ones((2, 4), np.float32)},
              str(folder / "adapter_model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def adapter_template(box: Path) -> Path:
    source = _lora(box / "template-peft")
    adapter = CalibrationAdapter(
        base_model=ModelIdentity("tiny", VOCAB, "ab" * 32),
        tau=np.linspace(0.5, 2.0, VOCAB), shift=np.linspace(-1.0, 1.0, VOCAB),
        temperature=1.25, answer_temperature=0.75, kind="daca",
        method={"name": "daca", "settings": {"seed": 0}}, metrics={"ece": 0.1},
        p_true_template="kadavath", lora_path=source)
    target = adapter.save_pretrained(box / "template" / "adapter")
    shutil.rmtree(source)
    assert (target / "lora" / "adapter_config.json").is_file()
    return target


def _check_adapter(loaded: CalibrationAdapter, root: Path, out: Path) -> None:
    """A loaded adapter is valid, holds nothing from outside, and round-trips."""
    loaded.validate()
    vocab = loaded.base_model.vocab_size
    assert loaded.tau.shape == (vocab,) and loaded.shift.shape == (vocab,)
    assert loaded.tau.dtype == np.float32 and loaded.shift.dtype == np.float32
    if loaded.lora_path is not None:
        assert root.resolve() in Path(loaded.lora_path).resolve().parents
    saved, error = _outcome(loaded.save_pretrained, out)
    assert error is None, f"a loaded adapter cannot be saved again: {error}"
    again = CalibrationAdapter.from_pretrained(saved)
    np.testing.assert_array_equal(again.tau, loaded.tau)
    np.testing.assert_array_equal(again.shift, loaded.shift)
    assert (again.temperature, again.answer_temperature, again.kind, again.base_model) == (
        loaded.temperature, loaded.answer_temperature, loaded.kind, loaded.base_model)
    assert again.method == loaded.method and again.p_true_template == loaded.p_true_template
    for dirpath, _, filenames in os.walk(saved):
        for name in filenames:
            path = Path(dirpath) / name
            assert not path.is_symlink(), f"the saved adapter holds a link: {path}"
            assert SECRET not in path.read_bytes(), f"{path} carries the outside secret"


def _load_and_check(root: Path, folder: Path) -> None:
    before = _listing(folder)
    loaded, _ = _outcome(CalibrationAdapter.from_pretrained, root)
    assert _listing(folder) == before, "loading changed files"
    if loaded is not None:
        _check_adapter(loaded, root, folder / "resaved")


@_settings(max_examples=350)
@given(ops=mutations, edit=raw_edits)
def test_fuzz_adapter_manifest(box, adapter_template, ops, edit):
    CASES["adapter_manifest"] += 1
    with _example(box, adapter_template) as folder:
        root = folder / adapter_template.name
        manifest = json.loads((root / MANIFEST_NAME).read_text())
        (root / MANIFEST_NAME).write_bytes(_dumps(_mutate(manifest, ops), edit))
        _load_and_check(root, folder)


def _header_and_data(raw: bytes) -> tuple[dict, bytes]:
    size = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + size]), raw[8 + size:]


tensor_files = st.one_of(
    st.tuples(st.just("random"), st.binary(max_size=1024)),
    st.tuples(st.just("header"), mutations, st.integers(-64, 64), st.booleans()),
    st.tuples(st.just("length"), st.integers(0, 2 ** 64 - 1)),
    st.tuples(st.just("length_delta"), st.integers(-16, 16)),
    st.tuples(st.just("flips"), st.lists(st.tuples(_index, st.integers(0, 255)), min_size=1,
                                         max_size=8)),
    st.tuples(st.just("resize"), st.integers(-200, 200)),
    # a sparse file of 4 or 100 GB whose header describes it exactly: refused by its size
    st.tuples(st.just("sparse"), st.sampled_from([10 ** 9, 25 * 10 ** 9])),
)


def _sparse_tensors(path: Path, elements: int) -> None:
    header, offset = {}, 0
    for name, count in (("tau", elements), ("shift", VOCAB), ("temperature", 1)):
        shape = [count] if name != "temperature" else []
        header[name] = {"dtype": "F32", "shape": shape,
                        "data_offsets": [offset, offset + 4 * count]}
        offset += 4 * count
    blob = json.dumps(header).encode()
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(blob)) + blob)
        handle.truncate(8 + len(blob) + offset)  # no disk blocks


def _mutated_tensors(raw: bytes, how: tuple) -> bytes:
    kind = how[0]
    if kind == "random":
        return how[1]
    if kind == "header":
        header, data = _header_and_data(raw)
        blob = _dumps(_mutate(header, how[1]))
        if how[3]:  # pad like safetensors does (spaces after the JSON)
            blob += b" " * 7
        data = data[:len(data) + how[2]] if how[2] < 0 else data + b"\0" * how[2]
        return struct.pack("<Q", len(blob)) + blob + data
    if kind == "length":
        return struct.pack("<Q", how[1]) + raw[8:]
    if kind == "length_delta":
        return struct.pack("<Q", max(0, struct.unpack("<Q", raw[:8])[0] + how[1])) + raw[8:]
    if kind == "flips":
        data = bytearray(raw)
        for position, byte in how[1]:
            data[position % len(data)] = byte
        return bytes(data)
    delta = how[1]
    return raw[:len(raw) + delta] if delta < 0 else raw + b"\0" * delta


@_settings(max_examples=350)
@given(how=tensor_files, keep_entries=st.booleans())
def test_fuzz_adapter_tensors_file(box, adapter_template, how, keep_entries):
    CASES["adapter_tensors"] += 1
    with _example(box, adapter_template) as folder:
        root = folder / adapter_template.name
        path = root / TENSORS_NAME
        if how[0] == "sparse":
            _sparse_tensors(path, how[1])
        else:
            path.write_bytes(_mutated_tensors(path.read_bytes(), how))
        if not keep_entries:  # so that header edits reach the deeper checks too
            manifest = json.loads((root / MANIFEST_NAME).read_text())
            del manifest["tensors"]["entries"]
            (root / MANIFEST_NAME).write_text(json.dumps(manifest))
        _load_and_check(root, folder)


LOCATIONS = ["lora/extra.txt", "lora/sub/deep.bin", "lora/adapter_config.json",
             "lora/adapter_model.safetensors", "lora/sub", "lora", TENSORS_NAME,
             MANIFEST_NAME, "other"]
TREE_KINDS = ["link_secret", "link_secret_dir", "link_secret_relative", "link_inside_file",
              "link_tensors", "link_dot", "link_parent", "dangling", "loop", "self_loop",
              "fifo", "dir", "file", "remove"]
tree_ops = st.lists(st.tuples(st.sampled_from(LOCATIONS), st.sampled_from(TREE_KINDS)),
                    min_size=1, max_size=4)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _apply_tree(root: Path, secret: Path, ops: list) -> None:
    for location, kind in ops:
        path = root / location
        with contextlib.suppress(OSError):
            _remove(path)
        if kind == "remove":
            continue
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            if kind == "link_secret":
                path.symlink_to(secret)
            elif kind == "link_secret_dir":
                path.symlink_to(secret.parent, target_is_directory=True)
            elif kind == "link_secret_relative":
                path.symlink_to(os.path.relpath(secret, path.parent))
            elif kind == "link_inside_file":
                path.symlink_to(os.path.relpath(root / "lora" / "adapter_config.json",
                                                path.parent))
            elif kind == "link_tensors":
                path.symlink_to(os.path.relpath(root / TENSORS_NAME, path.parent))
            elif kind == "link_dot":
                path.symlink_to(".", target_is_directory=True)
            elif kind == "link_parent":
                path.symlink_to("..", target_is_directory=True)
            elif kind == "dangling":
                path.symlink_to("no-such-target")
            elif kind == "loop":
                path.symlink_to(path.name + ".2")
                (path.parent / (path.name + ".2")).symlink_to(path.name)
            elif kind == "self_loop":
                path.symlink_to(path.name)
            elif kind == "fifo":
                os.mkfifo(path)
            elif kind == "dir":
                path.mkdir()
            elif kind == "file":
                path.write_bytes(b"plain file")


@_settings(max_examples=200)
@given(ops=tree_ops)
def test_fuzz_adapter_file_tree(box, adapter_template, ops):
    CASES["adapter_tree"] += 1
    with _example(box, adapter_template) as folder:
        root = folder / adapter_template.name
        secret = folder / "home" / ".ssh" / "id_rsa"
        secret.parent.mkdir(parents=True)
        secret.write_bytes(SECRET)
        _apply_tree(root, secret, ops)
        _load_and_check(root, folder)
        # the same tree as the LoRA source of a new adapter: the save copies or refuses
        if (root / "lora").is_dir() or (root / "lora").is_symlink():
            adapter = CalibrationAdapter.identity(ModelIdentity("tiny", VOCAB),
                                                  lora_path=root / "lora")
            before = _listing(folder)
            saved, error = _outcome(adapter.save_pretrained, folder / "new")
            if error is not None:
                assert _listing(folder) == before, "a refused save left something behind"
            else:
                _check_adapter(CalibrationAdapter.from_pretrained(saved), saved,
                               folder / "new2")


# ---------------------------------------------------------------------- engines
def _tokenizer_json(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "A": 4, "B": 5, "hello": 6}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))


ENGINE_TOKENIZER_CONFIG = {"bos_token": "<s>", "eos_token": {"content": "</s>"},
                           "pad_token": "<pad>", "model_max_length": 64,
                           "chat_template": [{"name": "default",
                                              "template": "{{ messages[0]['content'] }}"}]}


@pytest.fixture(scope="module")
def engine_template(box: Path) -> Path:
    root = box / "template-engine" / "engine"
    root.mkdir(parents=True)
    (root / "model.onnx").write_bytes(synthetic_onnx_graph())
    _tokenizer_json(root / "tokenizer.json")
    (root / "tokenizer_config.json").write_text(json.dumps(ENGINE_TOKENIZER_CONFIG))
    (root / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{% endfor %}")
    (root / "genai_config.json").write_text(synthetic_genai_config())
    manifest = synthetic_engine_manifest(
        root, adapter_kind="daca", export={"cloze_variant": "mean"},
        adapter={"kind": "daca", "path_name": "adapter", "tensors_sha256": None,
                 "manifest_sha256": None})
    (root / ENGINE_MANIFEST_NAME).write_text(json.dumps(manifest))
    tokenizer = EngineTokenizer(EngineManifest.load(root))
    assert tokenizer.has_chat_template and tokenizer.encode("hello") == [1, 6]
    return root


def _load_engine_and_check(root: Path, folder: Path) -> None:
    before = _listing(folder)
    manifest, _ = _outcome(EngineManifest.load, root)
    tokenizer = None
    if manifest is not None:
        tokenizer, _ = _outcome(EngineTokenizer, manifest)
    assert _listing(folder) == before, "loading changed files"
    if manifest is None:
        return
    # consistent: the manifest writes and reads back the same; every listed file is inside
    copy_dir = folder / "copy"
    shutil.copytree(root, copy_dir, symlinks=False,  # links become files; the rest is left
                    ignore=lambda d, names: [n for n in names
                                             if not (Path(d) / n).is_file()])
    manifest.write(copy_dir)
    assert EngineManifest.load(copy_dir).to_dict() == manifest.to_dict()
    for name in manifest.listed_files():
        assert root.resolve() in manifest.path(name).parents
    if tokenizer is not None:
        ids = tokenizer.encode("hello A")
        assert all(isinstance(i, int) for i in ids)
        if tokenizer.has_chat_template:
            _outcome(tokenizer.render_chat, "hello")


@_settings(max_examples=350)
@given(ops=mutations, edit=raw_edits)
def test_fuzz_engine_manifest(box, engine_template, ops, edit):
    CASES["engine_manifest"] += 1
    with _example(box, engine_template) as folder:
        root = folder / engine_template.name
        manifest = json.loads((root / ENGINE_MANIFEST_NAME).read_text())
        (root / ENGINE_MANIFEST_NAME).write_bytes(_dumps(_mutate(manifest, ops), edit))
        _load_engine_and_check(root, folder)


ENGINE_LOCATIONS = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "model.onnx", "genai_config.json", "other"]


@_settings(max_examples=200)
@given(ops=mutations, edit=raw_edits, rehash=st.booleans(),
       tree=st.lists(st.tuples(st.sampled_from(ENGINE_LOCATIONS), st.sampled_from(TREE_KINDS)),
                     max_size=2))
def test_fuzz_engine_tokenizer_config_and_tree(box, engine_template, ops, edit, rehash, tree):
    CASES["engine_tokenizer_tree"] += 1
    with _example(box, engine_template) as folder:
        root = folder / engine_template.name
        config = root / "tokenizer_config.json"
        config.write_bytes(_dumps(_mutate(ENGINE_TOKENIZER_CONFIG, ops), edit))
        secret = folder / "secret.json"
        secret.write_bytes(config.read_bytes())
        manifest = json.loads((root / ENGINE_MANIFEST_NAME).read_text())
        for location, kind in tree:
            with contextlib.suppress(OSError):
                _remove(root / location)
            if kind == "remove":
                continue
            with contextlib.suppress(OSError):
                if kind.startswith("link_secret"):
                    (root / location).symlink_to(secret)
                elif kind in ("dangling", "self_loop", "fifo", "dir", "file", "loop"):
                    _apply_tree(root, secret, [(location, kind)])
                else:
                    (root / location).symlink_to("genai_config.json")
        if rehash:  # so the content reaches the parsers, not only the hash check
            for name in manifest["tokenizer"]["files"]:
                if (root / name).is_file():  # (never open a FIFO here: it would block)
                    manifest["tokenizer"]["files"][name] = sha256_file(root / name)
            (root / ENGINE_MANIFEST_NAME).write_text(json.dumps(manifest))
        _load_engine_and_check(root, folder)


# ---------------------------------------------------------------------- JSONL
_record_texts = st.text(min_size=1, max_size=10)
valid_records = st.one_of(
    st.fixed_dictionaries({"question": _record_texts,
                           "choices": st.lists(_record_texts, min_size=2, max_size=4)},
                          optional={"answer": st.none() | st.integers(0, 1),
                                    "subject": st.none() | _record_texts,
                                    "id": st.none() | _record_texts}),
    st.fixed_dictionaries({"question": _record_texts,
                           "answers": st.lists(_record_texts, min_size=1, max_size=3)},
                          optional={"id": st.none() | _record_texts}),
)
jsonl_lines = st.one_of(
    valid_records.map(lambda r: _dumps(r)),
    st.tuples(valid_records, mutations, raw_edits).map(lambda t: _dumps(_mutate(t[0], t[1]),
                                                                          t[2])),
    st.binary(max_size=40),
    st.sampled_from([b"", b"   ", b"\xef\xbb\xbf", b"null", b"[]", b'"text"', b"NaN",
                     b'{"question": "q", "choices": ["a", "b"], "answer": 1.0}',
                     b'{"question": "q", "choices": ["a", "b"], "answer": NaN}',
                     b'{"question": "\\ud800", "answers": ["a"]}',
                     b'{"question": "q", "answers": ' + _nest(5000).encode() + b"}"]),
)


@_settings(max_examples=350)
@given(lines=st.lists(jsonl_lines, min_size=1, max_size=5), bom=st.booleans(),
       ending=st.sampled_from([b"\n", b"\r\n"]))
def test_fuzz_jsonl_reader(box, lines, bom, ending):
    CASES["jsonl"] += 1
    with _example(box) as folder:
        path = folder / "data.jsonl"
        path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + ending.join(lines) + ending)
        before = _listing(folder)
        records, _ = _outcome(read_jsonl, path)
        assert _listing(folder) == before
        if records is None:
            return
        assert records and len({r.kind for r in records}) == 1
        assert len(dataset_hash(records)) == 64
        again = write_jsonl(folder / "again.jsonl", records)
        assert read_jsonl(again) == records


def test_zz_case_count():
    """How many examples the properties above ran (all of them ran in this session)."""
    expected = {"adapter_manifest", "adapter_tensors", "adapter_tree", "engine_manifest",
                "engine_tokenizer_tree", "jsonl"}
    if set(CASES) != expected:
        pytest.skip("only part of the file ran")
    print(f"\nfuzz cases: {sum(CASES.values())} ({dict(sorted(CASES.items()))})")
    assert all(count >= 100 for count in CASES.values()), CASES
