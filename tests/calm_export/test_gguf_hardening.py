"""``calm-export --format gguf`` on mutated GGUF files: every tensor and key the head route
reads as a value (the head, its bias, the embedding, the architecture, the soft cap, the
alignment) is checked before use, so a wrong type, a wrong shape, an out-of-range number, a
missing or an extra key ends in exit 1 with exactly one line on stderr, no traceback and no
output file; and the sizes a file declares (alignment, tensor and string counts) drive no
allocation beyond a named cap.

The files are written byte by byte here (:func:`write_gguf_spec`), so that a mutation can
give a key or a tensor any type, shape or value GGUF can encode."""

from __future__ import annotations

import struct
import time
import tracemalloc

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from calm_export.gguf_file import TensorOut, open_source, write_gguf  # noqa: E402
from calm_runtime.errors import ArtifactError  # noqa: E402
from calm_runtime.extras import missing  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter, ModelIdentity  # noqa: E402
from calm_runtime.formats.gguf_layout import (  # noqa: E402
    MAX_ALIGNMENT,
    MAX_STRING_ITEMS,
    MAX_TENSORS,
    check_gguf_layout,
)

VOCAB, DIM = 64, 32
U8, U32, F32V, BOOL, STR, ARR, U64, F64V = 0, 4, 6, 7, 8, 9, 10, 12
F32, F16, Q8_0, Q8_1, I8, I32, F64 = 0, 1, 8, 9, 24, 26, 28


def _string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def _value(kind: int, value) -> bytes:
    if kind == STR:
        return _string(value)
    if kind == ARR:
        item, items = value
        body = struct.pack("<IQ", item, len(items))
        return body + b"".join(_value(item, v) for v in items)
    code = {U8: "B", U32: "I", F32V: "f", BOOL: "?", U64: "Q", F64V: "d"}[kind]
    return struct.pack("<" + code, value)


def write_gguf_spec(path, spec: dict):
    """A GGUF v3 file from ``spec``: ``keys`` (name -> (value type, value), in order, a
    list of pairs where a name repeats), ``tensors`` (name -> (ggml type, dims ne0 first,
    raw bytes)) and ``alignment``."""
    keys = spec["keys"]
    pairs = list(keys.items()) if isinstance(keys, dict) else list(keys)
    tensors = list(spec["tensors"].items()) if isinstance(spec["tensors"], dict) \
        else list(spec["tensors"])
    align = spec.get("alignment", 32)
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(pairs)))
    for name, (kind, value) in pairs:
        out += _string(name) + struct.pack("<I", kind) + _value(kind, value)
    offset = 0
    for name, (kind, dims, raw) in tensors:
        offset += -offset % align
        out += _string(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
        out += struct.pack("<IQ", kind, offset)
        offset += len(raw)
    out += b"\0" * (-len(out) % align)
    start = len(out)
    for _, (_, _, raw) in tensors:
        out += b"\0" * (-(len(out) - start) % align)
        out += raw
    path.write_bytes(bytes(out))
    return path


def _f32(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).tobytes()


def base_spec(arch="qwen2", *, tied=False, bias=True, softcap=None) -> dict:
    """A small valid model of ``arch``: an untied F32 head with an output bias (qwen2
    carries one), or a tied head (gemma3 with a soft cap)."""
    keys = {"general.architecture": (STR, arch), "general.name": (STR, "tiny"),
            f"{arch}.block_count": (U32, 1), f"{arch}.embedding_length": (U32, DIM),
            "tokenizer.ggml.model": (STR, "gpt2"),
            "tokenizer.ggml.tokens": (ARR, (STR, [f"t{i}" for i in range(VOCAB)]))}
    if softcap is not None:
        keys[f"{arch}.final_logit_softcapping"] = (F32V, softcap)
    tensors = {"token_embd.weight": (F32, [DIM, VOCAB], _f32((VOCAB, DIM))),
               "blk.0.attn_norm.weight": (F32, [DIM], _f32(DIM, 1)),
               "output_norm.weight": (F32, [DIM], _f32(DIM, 2))}
    if not tied:
        tensors["output.weight"] = (F32, [DIM, VOCAB], _f32((VOCAB, DIM), 3))
    if bias:
        tensors["output.bias"] = (F32, [VOCAB], _f32(VOCAB, 4))
    return {"keys": keys, "tensors": tensors}


def softcap_spec(value=30.0, kind=F32V) -> dict:
    spec = base_spec("gemma3", tied=True, bias=False, softcap=30.0)
    spec["keys"]["gemma3.final_logit_softcapping"] = (kind, value)
    return spec


def _bias(spec, kind, dims, raw):
    spec["tensors"]["output.bias"] = (kind, dims, raw)
    return spec


def _set_key(spec, name, kind, value):
    spec["keys"][name] = (kind, value)
    return spec


def _drop_key(spec, name):
    del spec["keys"][name]
    return spec


def _nan_bias(value):
    values = np.frombuffer(_f32(VOCAB, 4), np.float32).copy()
    values[5] = value
    return values.tobytes()


#: (case, valid file it mutates, the mutation, what the one line must say)
MUTATIONS = [
    # wrong type
    ("bias F64", base_spec, lambda s: _bias(s, F64, [VOCAB], np.ones(VOCAB).tobytes()),
     "output.bias .* F64"),
    ("bias I32", base_spec, lambda s: _bias(s, I32, [VOCAB],
                                            np.ones(VOCAB, np.int32).tobytes()),
     "output.bias .* I32"),
    ("bias Q8_1", base_spec, lambda s: _bias(s, Q8_1, [VOCAB], bytes(40 * VOCAB // 32)),
     "output.bias .* Q8_1"),
    ("head I8", lambda: base_spec(bias=False), lambda s: s["tensors"].update(
        {"output.weight": (I8, [DIM, VOCAB], bytes(DIM * VOCAB))}) or s, "output.weight"),
    ("soft cap uint32", softcap_spec, lambda s: _set_key(
        s, "gemma3.final_logit_softcapping", U32, 30), "final_logit_softcapping"),
    ("soft cap string", softcap_spec, lambda s: _set_key(
        s, "gemma3.final_logit_softcapping", STR, "30"), "final_logit_softcapping"),
    ("architecture uint32", base_spec, lambda s: _set_key(s, "general.architecture", U32, 7),
     "general.architecture"),
    ("alignment uint64", base_spec, lambda s: _set_key(s, "general.alignment", U64, 32),
     "general.alignment"),
    # wrong shape
    ("bias of 7", base_spec, lambda s: _bias(s, F32, [7], _f32(7)), r"output.bias .*\[7\]"),
    ("bias of 65", base_spec, lambda s: _bias(s, F32, [65], _f32(65)), r"output.bias .*\[65\]"),
    ("bias of 128", base_spec, lambda s: _bias(s, F32, [128], _f32(128)),
     r"output.bias .*\[128\]"),
    ("bias 2-D", base_spec, lambda s: _bias(s, F32, [VOCAB, 2], _f32((2, VOCAB))),
     "output.bias"),
    ("head 3-D", base_spec, lambda s: s["tensors"].update(
        {"output.weight": (F32, [DIM, VOCAB, 1], _f32((VOCAB, DIM)))}) or s, "output.weight"),
    ("embedding 1-D", base_spec, lambda s: s["tensors"].update(
        {"token_embd.weight": (F32, [DIM * VOCAB], _f32((VOCAB, DIM)))}) or s,
     "token_embd.weight"),
    # out-of-range numbers
    ("bias NaN", base_spec, lambda s: _bias(s, F32, [VOCAB], _nan_bias(np.nan)),
     "output.bias .*non-finite"),
    ("bias inf", base_spec, lambda s: _bias(s, F32, [VOCAB], _nan_bias(np.inf)),
     "output.bias .*non-finite"),
    ("head NaN", base_spec, lambda s: s["tensors"].update(
        {"output.weight": (F32, [DIM, VOCAB], np.full(DIM * VOCAB, np.nan,
                                                       np.float32).tobytes())}) or s,
     "output.weight .*non-finite"),
    ("soft cap NaN", lambda: softcap_spec(float("nan")), lambda s: s,
     "final_logit_softcapping"),
    ("soft cap inf", lambda: softcap_spec(float("inf")), lambda s: s,
     "final_logit_softcapping"),
    ("soft cap negative", lambda: softcap_spec(-30.0), lambda s: s,
     "final_logit_softcapping"),
    ("soft cap subnormal", lambda: softcap_spec(1.4e-45), lambda s: s,
     "final_logit_softcapping"),
    ("soft cap 1e300", lambda: softcap_spec(1e300, F64V), lambda s: s,
     "final_logit_softcapping"),
    ("alignment 2^17", base_spec, lambda s: _set_key(dict(s, alignment=1 << 17),
                                                     "general.alignment", U32, 1 << 17),
     "general.alignment"),
    ("alignment 3", base_spec, lambda s: _set_key(s, "general.alignment", U32, 3),
     "general.alignment"),
    # missing keys
    ("no architecture", base_spec, lambda s: _drop_key(s, "general.architecture"),
     "general.architecture"),
    ("no head", lambda: base_spec(tied=True, bias=False), lambda s: s["tensors"].pop(
        "token_embd.weight") and s, "token_embd.weight"),
    # extra keys
    ("already calibrated", base_spec, lambda s: _set_key(s, "calm.temperature", F32V, 2.0),
     "calm.temperature"),
    ("extra head tensor", base_spec, lambda s: s["tensors"].update(
        {"output.scale": (F32, [VOCAB], _f32(VOCAB))}) or s, "output.scale"),
    ("logit scale", base_spec, lambda s: _set_key(s, "qwen2.logit_scale", F32V, 2.0),
     "logit_scale"),
    ("duplicate key", base_spec, lambda s: s.update(keys=[*s["keys"].items(),
                                                          ("general.name", (STR, "again"))])
     or s, "general.name"),
    ("duplicate tensor", base_spec, lambda s: s.update(tensors=[
        *s["tensors"].items(), ("output_norm.weight", (F32, [DIM], _f32(DIM)))]) or s,
     "output_norm.weight"),
]


@pytest.fixture
def adapter_dir(tmp_path, monkeypatch):
    (tmp_path / "cache").mkdir()
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    made = CalibrationAdapter(
        base_model=ModelIdentity("tiny", VOCAB, None), tau=np.ones(VOCAB, np.float32),
        shift=np.zeros(VOCAB, np.float32), temperature=2.0, kind="ts",
        method={"mode": "letter"})
    return made.save_pretrained(tmp_path / "adapter")


def _export(source, adapter, out) -> int:
    from calm_export.cli import main

    return main(["--model", str(source), "--adapter", str(adapter), "--format", "gguf",
                 "--out", str(out), "--quiet"])


needs_cli = pytest.mark.skipif(bool(missing("export")),
                               reason="calm-export's CLI needs the export extra")


@needs_cli
@pytest.mark.parametrize("make", [base_spec, softcap_spec], ids=["qwen2-bias", "gemma3-cap"])
def test_the_valid_files_export(tmp_path, adapter_dir, capsys, make):
    source = write_gguf_spec(tmp_path / "valid.gguf", make())
    assert _export(source, adapter_dir, tmp_path / "out.gguf") == 0, capsys.readouterr().err
    assert (tmp_path / "out.gguf").is_file()


@needs_cli
@pytest.mark.parametrize("case, make, mutate, match", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_every_mutated_field_is_one_line_and_nothing_written(tmp_path, adapter_dir, capsys,
                                                              case, make, mutate, match):
    import re

    source = write_gguf_spec(tmp_path / "mutated.gguf", mutate(make()))
    out = tmp_path / "out.gguf"
    code = _export(source, adapter_dir, out)
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert code == 1, (case, captured.out, captured.err)
    assert len(err) == 1 and re.match(r"^[A-Za-z]+Error: \S", err[0]), err
    assert "Traceback" not in captured.err
    assert re.search(match, err[0]), (match, err[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "cache", "mutated.gguf"]


@needs_cli
def test_a_file_name_with_control_characters_is_shown_escaped(tmp_path, adapter_dir, capsys):
    spec = base_spec()
    _bias(spec, F32, [7], _f32(7))
    source = write_gguf_spec(tmp_path / "a\x1b[2Jb\nc.gguf", spec)
    assert _export(source, adapter_dir, tmp_path / "out.gguf") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err, repr(err)
    assert "\\x1b" in err


def test_a_written_soft_cap_and_bias_are_representable(tmp_path, adapter_dir):
    """A cap that T makes subnormal in float32, and a bias T makes overflow, are refused."""
    from calm_export.config import ExportConfig
    from calm_export.gguf import export_gguf

    tiny_t = CalibrationAdapter(
        base_model=ModelIdentity("tiny", VOCAB, None), tau=np.ones(VOCAB, np.float32),
        shift=np.zeros(VOCAB, np.float32), temperature=1e-3, kind="ts",
        method={"mode": "letter"}).save_pretrained(tmp_path / "hot")
    source = write_gguf_spec(tmp_path / "cap.gguf", softcap_spec(1e36))
    with pytest.raises(ArtifactError, match="final_logit_softcapping") as caught:
        export_gguf(source, tmp_path / "out.gguf", adapter=tiny_t,
                    config=ExportConfig(format="gguf"))
    assert "float32" in str(caught.value)
    spec = base_spec()
    _bias(spec, F32, [VOCAB], np.full(VOCAB, 1e36, np.float32).tobytes())
    source = write_gguf_spec(tmp_path / "bias.gguf", spec)
    with pytest.raises(ArtifactError, match="output.bias"):
        export_gguf(source, tmp_path / "out.gguf", adapter=tiny_t,
                    config=ExportConfig(format="gguf"))
    assert not (tmp_path / "out.gguf").exists()


# ------------------------------------------------------------ sizes that drive allocation
def _peak(fn, *args):
    tracemalloc.start()
    try:
        result = fn(*args)
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_an_alignment_above_the_cap_is_refused_before_anything_is_read(tmp_path):
    spec = base_spec()
    spec["keys"]["general.alignment"] = (U32, MAX_ALIGNMENT * 2)
    path = write_gguf_spec(tmp_path / "aligned.gguf", spec)
    with pytest.raises(ArtifactError, match=f"at most {MAX_ALIGNMENT:,}"):
        check_gguf_layout(path)
    spec["keys"]["general.alignment"], spec["alignment"] = (U32, MAX_ALIGNMENT), MAX_ALIGNMENT
    check_gguf_layout(write_gguf_spec(tmp_path / "at-cap.gguf", spec))


def test_padding_is_written_in_chunks_not_as_one_object(tmp_path):
    alignment = 1 << 23
    tensor = TensorOut("t", (4,), F32, 16, array=np.ones(4, np.float32))
    with open(tmp_path / "padded.gguf", "wb") as handle:
        _, peak = _peak(lambda: write_gguf(handle, version=3, alignment=alignment, kv=[],
                                           tensors=[tensor, tensor],
                                           source_path=tmp_path / "padded.gguf"))
    assert (tmp_path / "padded.gguf").stat().st_size == 2 * alignment + 16
    assert peak < alignment // 4, f"peak {peak:,} bytes"


def _empty_tokens_file(path, items: int):
    """A valid model whose vocabulary array holds ``items`` empty strings (8 bytes each)."""
    spec = base_spec()
    spec["keys"]["tokenizer.ggml.merges"] = (ARR, (STR, [""] * items))
    return write_gguf_spec(path, spec)


def test_a_large_string_array_is_read_without_an_object_per_item(tmp_path):
    items = 1 << 17
    path = _empty_tokens_file(tmp_path / "tokens.gguf", items)
    started = time.perf_counter()
    source, peak = _peak(open_source, path)
    seconds = time.perf_counter() - started
    assert source.array_length("tokenizer.ggml.merges") == items
    assert source.value("general.architecture") == "qwen2"
    # the array's own 1 MiB of bytes is kept once (copied byte for byte); nothing per item
    assert peak < 8 * 2 ** 20, f"peak {peak:,} bytes"
    assert seconds < 5.0


def test_string_items_beyond_the_cap_are_refused_by_the_layout(tmp_path):
    half = MAX_STRING_ITEMS // 2 + 1
    spec = base_spec()
    spec["keys"]["a"] = (ARR, (STR, [""] * half))
    spec["keys"]["b"] = (ARR, (STR, [""] * half))
    path = write_gguf_spec(tmp_path / "strings.gguf", spec)
    with pytest.raises(ArtifactError, match=f"more than {MAX_STRING_ITEMS:,} strings"):
        check_gguf_layout(path)


@pytest.mark.parametrize("count", [MAX_TENSORS + 1, 60_000])
def test_tensor_counts_are_bounded_by_the_cap_and_the_file(tmp_path, count):
    """More tensors than the cap, or than the file's bytes can describe (32 bytes each at
    least): refused before any tensor is read."""
    info = _string("t") + struct.pack("<IQIQ", 1, 1, F32, 0)
    n_written = count if count > MAX_TENSORS else 10
    body = b"GGUF" + struct.pack("<IQQ", 3, count, 0) + info * n_written
    path = tmp_path / "tensors.gguf"
    path.write_bytes(body + b"\0" * (-len(body) % 32) + b"\0" * 64)
    started = time.perf_counter()
    _, peak = _peak(lambda: pytest.raises(ArtifactError, check_gguf_layout, path))
    assert time.perf_counter() - started < 1.0 and peak < 2 ** 20
    with pytest.raises(ArtifactError, match="tensors") as caught:
        check_gguf_layout(path)
    assert f"{count:,}" in str(caught.value)
