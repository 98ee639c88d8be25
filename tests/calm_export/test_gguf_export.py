"""``calm-export --format gguf`` on tiny GGUF files written here with gguf's own writer:
every source tensor and key copied byte for byte, the head the calibration formula (read
back with gguf's own dequantize), the calm.* keys, the shift refused in one line or dropped,
and a write that leaves nothing behind when it fails."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from calm_export.config import ExportConfig  # noqa: E402
from calm_export.gguf import export_gguf  # noqa: E402
from calm_export.gguf_file import BLOCK_SCALES, rescale_rows  # noqa: E402
from calm_runtime.calibration import fused_head  # noqa: E402
from calm_runtime.errors import ArtifactError, IncompatibleModelError  # noqa: E402
from calm_runtime.extras import missing  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter, ModelIdentity  # noqa: E402

VOCAB, DIM = 40, 32
Q8_0 = gguf.GGMLQuantizationType.Q8_0


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    (tmp_path / "cache").mkdir()
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))


def tiny_gguf(path, *, arch="llama", tied=True, head_q8=False, bias=False, softcap=None,
              head_cols=None, head_nan=False):
    """A tiny GGUF of ``arch`` (one block, F32 tensors; the head Q8_0 with ``head_q8``; a
    damaged untied head ``head_cols`` wide, or all NaN, when asked)."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_token_types([1] * VOCAB)
    writer.add_string("general.name", "tiny")
    if softcap is not None:
        writer.add_float32(f"{arch}.final_logit_softcapping", softcap)

    def add(name, shape, q8=False, nan=False):
        values = rng.standard_normal(shape).astype(np.float32)
        if nan:
            values[:] = np.nan
        if q8:
            writer.add_tensor(name, gguf.quants.quantize(values, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(name, values)

    add("token_embd.weight", (VOCAB, DIM), q8=head_q8 and tied)
    for name, shape in (("attn_norm", (DIM,)), ("attn_q", (DIM, DIM)), ("attn_k", (16, DIM)),
                        ("attn_v", (16, DIM)), ("attn_output", (DIM, DIM)), ("ffn_norm", (DIM,)),
                        ("ffn_gate", (64, DIM)), ("ffn_up", (64, DIM)), ("ffn_down", (DIM, 64))):
        add(f"blk.0.{name}.weight", shape)
    if not tied:
        add("output.weight", (VOCAB, head_cols or DIM), q8=head_q8, nan=head_nan)
    if bias:
        add("output.bias", (VOCAB,))
    add("output_norm.weight", (DIM,))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def adapter(tmp_path, *, tau=None, shift=None, temperature=2.5, centered=False,
            answer_temperature=1.7, name="adapter"):
    made = CalibrationAdapter(
        base_model=ModelIdentity("tiny", VOCAB, None),
        tau=np.ones(VOCAB, np.float32) if tau is None else tau,
        shift=np.zeros(VOCAB, np.float32) if shift is None else shift,
        temperature=temperature, answer_temperature=answer_temperature, kind="daca",
        method={"mode": "letter"}, centered=centered)
    return made.save_pretrained(tmp_path / name)


def per_token_tau():
    return np.random.default_rng(1).uniform(0.5, 2.0, VOCAB).astype(np.float32)


def head_of(reader, name):
    tensor = next(t for t in reader.tensors if t.name == name)
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return tensor, np.asarray(values, np.float32).reshape(VOCAB, -1) if name.endswith(
        "weight") else np.asarray(values, np.float32).reshape(-1)


def fields(reader):
    return {k: b"".join(bytes(p) for p in f.parts) for k, f in reader.fields.items()
            if not k.startswith("GGUF.")}


def value(reader, key):
    return reader.fields[key].contents()


def export(tmp_path, source, adapter_dir, out="calibrated.gguf", **settings):
    return export_gguf(source, tmp_path / out, adapter=adapter_dir,
                       config=ExportConfig(format="gguf", **settings))


def test_a_tied_head_is_untied_calibrated_and_everything_else_copied(tmp_path):
    source = tiny_gguf(tmp_path / "tiny.gguf")
    tau = per_token_tau()
    result = export(tmp_path, source, adapter(tmp_path, tau=tau))
    old, new = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(result.path))
    assert [t.name for t in new.tensors] == [t.name for t in old.tensors] + ["output.weight"]
    for tensor in old.tensors:  # every source tensor: same type, shape and bytes
        twin = next(t for t in new.tensors if t.name == tensor.name)
        assert (twin.tensor_type, list(twin.shape)) == (tensor.tensor_type, list(tensor.shape))
        assert bytes(twin.data.tobytes()) == bytes(tensor.data.tobytes()), tensor.name
    old_fields, new_fields = fields(old), fields(new)
    assert all(new_fields[k] == raw for k, raw in old_fields.items())  # byte for byte
    assert list(new_fields)[:len(old_fields)] == list(old_fields)  # in the same order
    embedding = head_of(old, "token_embd.weight")[1]
    tensor, head = head_of(new, "output.weight")
    assert tensor.tensor_type == gguf.GGMLQuantizationType.F32  # an F32 source head stays F32
    expected, _ = fused_head(embedding, None, tau, None, 2.5)
    np.testing.assert_array_equal(head, expected.astype(np.float32))
    np.testing.assert_allclose(head, embedding / (tau * 2.5)[:, None], rtol=1e-6)
    assert value(new, "calm.calibrated") == "token_logprobs"
    assert value(new, "calm.temperature") == pytest.approx(2.5)
    assert value(new, "calm.answer_temperature") == pytest.approx(1.7)  # recorded, not folded
    assert value(new, "calm.shift") == "none"
    assert value(new, "calm.tau") == "per-vocabulary"
    assert value(new, "calm.adapter_kind") == "daca"
    assert len(value(new, "calm.adapter_sha256")) == 64
    assert value(new, "calm.head_type") == "F32"
    assert "untied" in value(new, "calm.head")
    assert result.copied_tensors == len(old.tensors)
    assert "calibrated GGUF" in result.summary() and "answer_temperature 1.7" in result.summary()


def test_a_quantised_head_keeps_its_type_with_rescaled_block_scales(tmp_path):
    source = tiny_gguf(tmp_path / "q8.gguf", head_q8=True)
    tau = per_token_tau()
    result = export(tmp_path, source, adapter(tmp_path, tau=tau, temperature=3.0))
    old, new = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(result.path))
    embedding, tensor = head_of(old, "token_embd.weight"), head_of(new, "output.weight")[0]
    assert embedding[0].tensor_type == Q8_0 and tensor.tensor_type == Q8_0
    np.testing.assert_allclose(head_of(new, "output.weight")[1],
                               embedding[1] / (tau * 3.0)[:, None], rtol=5e-4, atol=0)
    before = np.asarray(embedding[0].data).reshape(VOCAB, -1, 34)
    after = np.asarray(tensor.data).reshape(VOCAB, -1, 34)
    np.testing.assert_array_equal(after[..., 2:], before[..., 2:])  # the same int8 values
    assert value(new, "calm.head_type") == "Q8_0" and result.head["max_row_error"] < 5e-4


def test_a_centred_quantised_head_is_written_f16(tmp_path):
    source = tiny_gguf(tmp_path / "q8.gguf", head_q8=True)
    tau = per_token_tau()
    result = export(tmp_path, source, adapter(tmp_path, tau=tau, centered=True))
    old, new = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(result.path))
    tensor, head = head_of(new, "output.weight")
    assert tensor.tensor_type == gguf.GGMLQuantizationType.F16
    embedding = head_of(old, "token_embd.weight")[1]
    expected, _ = fused_head(embedding, None, tau, None, 2.5, center=True)
    np.testing.assert_array_equal(head, expected.astype(np.float16).astype(np.float32))
    assert value(new, "calm.head_type") == "F16" and value(new, "calm.centered") is True


def test_a_scale_float16_cannot_hold_is_written_f32(tmp_path):
    source = tiny_gguf(tmp_path / "q8.gguf", head_q8=True)
    tau = per_token_tau()
    tau[5] = 1e-4  # 1 / (tau T) = 1e7: the block scales and F16 weights overflow
    result = export(tmp_path, source, adapter(tmp_path, tau=tau, temperature=1e-3))
    old, new = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(result.path))
    tensor, head = head_of(new, "output.weight")
    assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
    np.testing.assert_allclose(head, head_of(old, "token_embd.weight")[1]
                               / (tau * 1e-3)[:, None], rtol=1e-6)
    assert "F16 would change a row" in result.head["type_reason"]


@pytest.mark.parametrize("name", sorted(BLOCK_SCALES))
def test_rescaling_the_block_scales_scales_every_value(name):
    """Random blocks of each type (their float16 fields set to ordinary numbers):
    gguf's dequantize of the rescaled rows is the scale times the original's."""
    qtype = gguf.GGMLQuantizationType[name]
    size, offsets = BLOCK_SCALES[name]
    block_values = gguf.GGML_QUANT_SIZES[qtype][0]
    rng = np.random.default_rng(2)
    rows, blocks = 6, 2
    data = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for offset in offsets:
        data[:, :, offset:offset + 2] = rng.uniform(0.01, 0.1, (rows, blocks, 1)).astype(
            np.float16).view(np.uint8)
    data = data.reshape(rows, -1)
    scale = rng.uniform(0.05, 4.0, rows)
    original = gguf.quants.dequantize(data, qtype).reshape(rows, blocks * block_values)
    rescaled = gguf.quants.dequantize(rescale_rows(data, name, scale), qtype).reshape(
        rows, blocks * block_values)
    expected = original * scale[:, None]
    # each float16 field rounds once (<= 2**-12 relative); where a K-quant's scale and min
    # terms cancel, that error is relative to the terms, so it is bounded per row
    bound = 5e-4 * np.abs(expected).max(axis=1, keepdims=True)
    assert np.all(np.abs(rescaled - expected) <= bound)
    assert np.all(np.linalg.norm(rescaled - expected, axis=1)
                  <= 1e-3 * np.linalg.norm(expected, axis=1))


def test_a_centred_adapter_folds_w_minus_its_mean_row(tmp_path):
    source = tiny_gguf(tmp_path / "tiny.gguf")
    tau = per_token_tau()
    result = export(tmp_path, source, adapter(tmp_path, tau=tau, centered=True))
    old, new = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(result.path))
    embedding = head_of(old, "token_embd.weight")[1]
    expected = (embedding - embedding.mean(axis=0, keepdims=True)) / (tau * 2.5)[:, None]
    np.testing.assert_allclose(head_of(new, "output.weight")[1], expected, rtol=1e-5,
                               atol=1e-6)
    assert value(new, "calm.centered") is True


def test_an_untied_head_is_replaced_in_place(tmp_path):
    source = tiny_gguf(tmp_path / "untied.gguf", tied=False, head_q8=True)
    result = export(tmp_path, source, adapter(tmp_path, temperature=2.0))
    old, new = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(result.path))
    assert [t.name for t in new.tensors] == [t.name for t in old.tensors]
    np.testing.assert_allclose(head_of(new, "output.weight")[1],
                               head_of(old, "output.weight")[1] / 2.0, rtol=1e-3)
    np.testing.assert_array_equal(head_of(new, "token_embd.weight")[1],
                                  head_of(old, "token_embd.weight")[1])
    assert "replacing" in value(new, "calm.head")


def _shift():
    shift = np.zeros(VOCAB, np.float32)
    shift[[3, 7]] = [0.5, -0.25]
    return shift


def test_a_shift_is_refused_in_one_line_naming_its_size(tmp_path):
    source = tiny_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(IncompatibleModelError) as caught:
        export(tmp_path, source, adapter(tmp_path, shift=_shift()))
    message = str(caught.value)
    assert "\n" not in message and "max |shift| 0.5" in message and "--drop-shift" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "cache", "tiny.gguf"]


def test_drop_shift_folds_tau_and_t_and_records_it(tmp_path):
    source = tiny_gguf(tmp_path / "tiny.gguf")
    tau = per_token_tau()
    result = export(tmp_path, source, adapter(tmp_path, tau=tau, shift=_shift()),
                    drop_shift=True)
    old, new = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(result.path))
    np.testing.assert_allclose(head_of(new, "output.weight")[1],
                               head_of(old, "token_embd.weight")[1] / (tau * 2.5)[:, None],
                               rtol=1e-6)
    assert "output.bias" not in {t.name for t in new.tensors}
    assert value(new, "calm.shift") == "dropped"
    assert value(new, "calm.shift_max_abs") == pytest.approx(0.5)


def test_qwen2_carries_the_shift_as_output_bias(tmp_path):
    source = tiny_gguf(tmp_path / "qwen.gguf", arch="qwen2")
    tau = per_token_tau()
    result = export(tmp_path, source, adapter(tmp_path, tau=tau, shift=_shift()))
    new = gguf.GGUFReader(str(result.path))
    assert [t.name for t in new.tensors][-2:] == ["output.weight", "output.bias"]
    np.testing.assert_allclose(head_of(new, "output.bias")[1], _shift() / 2.5, rtol=1e-6)
    assert value(new, "calm.shift") == "output.bias"


def test_a_source_bias_is_calibrated_too(tmp_path):
    source = tiny_gguf(tmp_path / "phi.gguf", arch="phi2", tied=False, bias=True)
    tau = per_token_tau()
    result = export(tmp_path, source, adapter(tmp_path, tau=tau, shift=_shift()))
    old, new = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(result.path))
    expected = (head_of(old, "output.bias")[1] / tau + _shift()) / 2.5
    np.testing.assert_allclose(head_of(new, "output.bias")[1], expected, rtol=1e-6)


def test_a_soft_cap_takes_one_temperature_and_is_rescaled(tmp_path):
    source = tiny_gguf(tmp_path / "gemma.gguf", arch="gemma3", softcap=30.0)
    with pytest.raises(IncompatibleModelError, match="soft-caps"):
        export(tmp_path, source, adapter(tmp_path, tau=per_token_tau()))
    result = export(tmp_path, source, adapter(tmp_path, temperature=2.0, name="scalar"))
    new = gguf.GGUFReader(str(result.path))
    assert value(new, "gemma3.final_logit_softcapping") == pytest.approx(15.0)
    assert value(new, "calm.softcap_source") == pytest.approx(30.0)


@pytest.mark.parametrize("case", ["always-tied", "calibrated", "vocabulary", "missing-adapter",
                                  "no-adapter", "suffix", "nothing-to-fold"])
def test_unusable_inputs_are_one_line(tmp_path, case):
    source = tiny_gguf(tmp_path / "tiny.gguf", arch="gemma2" if case == "always-tied"
                       else "llama")
    good = adapter(tmp_path)
    out, error = "out.gguf", (IncompatibleModelError, ArtifactError)
    if case == "calibrated":
        source = export(tmp_path, source, good, out="first.gguf").path
    elif case == "vocabulary":
        made = CalibrationAdapter(base_model=ModelIdentity("other", VOCAB + 1, None),
                                  tau=np.ones(VOCAB + 1, np.float32),
                                  shift=np.zeros(VOCAB + 1, np.float32), temperature=2.0)
        good = made.save_pretrained(tmp_path / "other")
    elif case == "missing-adapter":
        good = tmp_path / "missing-adapter"
    elif case == "no-adapter":
        good = None
        error = Exception
    elif case == "suffix":
        out, error = "out.bin", Exception
    elif case == "nothing-to-fold":  # only an answer temperature: no token transform
        good, error = adapter(tmp_path, temperature=1.0, name="answer-only"), Exception
    with pytest.raises(error) as caught:
        export(tmp_path, source, good, out=out)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / out).exists()


@pytest.mark.parametrize("damage, match", [
    ({"head_cols": DIM // 2}, "the embeddings' width"),
    ({"head_nan": True}, "non-finite values"),
])
def test_a_damaged_head_is_refused_before_anything_is_written(tmp_path, damage, match):
    source = tiny_gguf(tmp_path / "damaged.gguf", tied=False, **damage)
    with pytest.raises(ArtifactError, match=match) as caught:
        export(tmp_path, source, adapter(tmp_path))
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "calibrated.gguf").exists()


def test_a_fifo_as_out_is_refused_without_opening_it(tmp_path):
    import os

    source = tiny_gguf(tmp_path / "tiny.gguf")
    os.mkfifo(tmp_path / "pipe.gguf")
    with pytest.raises(ArtifactError, match="not a regular file"):
        export(tmp_path, source, adapter(tmp_path), out="pipe.gguf", overwrite=True)


def test_nothing_is_left_when_the_write_fails_and_the_old_file_stays(tmp_path, monkeypatch):
    import calm_export.gguf as module

    source = tiny_gguf(tmp_path / "tiny.gguf")
    first = export(tmp_path, source, adapter(tmp_path)).path
    before = first.read_bytes()
    with pytest.raises(ArtifactError, match="already exists"):
        export(tmp_path, source, adapter(tmp_path, temperature=4.0, name="second"))

    def broken(*args, **kwargs):
        raise ArtifactError("read back differently (simulated)")

    monkeypatch.setattr(module, "_verify", broken)
    with pytest.raises(ArtifactError, match="simulated"):
        export(tmp_path, source, tmp_path / "second", overwrite=True)
    assert first.read_bytes() == before  # the old file is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "cache", "calibrated.gguf",
                                                         "second", "tiny.gguf"]
    monkeypatch.undo()
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    export(tmp_path, source, tmp_path / "second", overwrite=True)
    assert value(gguf.GGUFReader(str(first)), "calm.temperature") == pytest.approx(4.0)


@pytest.mark.skipif(bool(missing("export")), reason="calm-export's CLI needs the export extra")
def test_the_command_line_refuses_a_shift_in_one_line_and_drops_it_when_asked(tmp_path,
                                                                                capsys):
    from calm_export.cli import main

    source = tiny_gguf(tmp_path / "tiny.gguf")
    shifted = adapter(tmp_path, shift=_shift())
    argv = ["--model", str(source), "--adapter", str(shifted), "--format", "gguf", "--out",
            str(tmp_path / "out.gguf"), "--quiet"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("IncompatibleModelError: ") \
        and "max |shift| 0.5" in err[0], err
    assert not (tmp_path / "out.gguf").exists()
    assert main([*argv, "--drop-shift"]) == 0
    assert "shift: dropped (max |shift| 0.5)" in capsys.readouterr().out
    assert main([*argv, "--drop-shift", "--quantize", "int4"]) == 1
    assert "--format gguf keeps the source's tensors" in capsys.readouterr().err
    assert main([*argv[:4], "--drop-shift", "--out", str(tmp_path / "x"), "--quiet"]) == 1
    assert "--drop-shift applies to --format gguf only" in capsys.readouterr().err
