"""``calm-export --dtype fp16`` on the builder's graph: built from weights loaded in float16
(no float32 model, graph or conversion), validated against the float32 computation on those
weights with the fp16 tolerance; its pieces (the half-precision head fusion, the float32
reference of a half model, the float32 logits of a float16 graph) checked on their own."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")

from onnx import TensorProto  # noqa: E402

from calm_export import ExportConfig, export_engine, fuse, validate  # noqa: E402
from calm_export.graphs.calm_graph import append_logits_affine  # noqa: E402
from calm_runtime.data.models import load_model_and_tokenizer  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter, ModelIdentity  # noqa: E402
from calm_runtime.inference.lm import CalibratedLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(scope="module")
def fp16_engine(runtime_engine, tmp_path_factory):
    """The runtime fixture's model (tied head, LoRA, per-token tau and shift, T = 1.2)
    exported with --dtype fp16 and the default graph."""
    model_dir, adapter_dir, _ = runtime_engine
    out = tmp_path_factory.mktemp("fp16-builder") / "engine"
    return export_engine(model_dir, out, adapter=adapter_dir,
                         config=ExportConfig(dtype="fp16", greedy_steps=4, progress=False))


def test_the_builder_builds_fp16_from_float16_weights(fp16_engine):
    manifest = fp16_engine.manifest
    assert manifest.model["dtype"] == "float16"
    assert manifest.export["graph"]["kind"] == "genai-builder"
    assert "-p fp16" in manifest.export["exporter_used"]
    report = manifest.validation
    assert report["passed"] and report["max_abs_diff"] <= report["tolerance"]
    assert report["atol"] == ExportConfig.ATOL_FP16  # the fp16 tolerance, no variant stage
    assert "float16 weights computed in float32" in report["reference"]
    assert "quantize" not in manifest.export["stages"]["seconds"]
    assert manifest.export["fp16"] is None  # no drift against an fp32 engine: none was built
    graph = onnx.load(str(fp16_engine.path / "model.onnx"), load_external_data=False)
    matrices = [t for t in graph.graph.initializer if len(t.dims) == 2 and min(t.dims) > 1]
    assert matrices and all(t.data_type == TensorProto.FLOAT16 for t in matrices)
    logits = next(o for o in graph.graph.output if o.name == "logits")
    assert logits.type.tensor_type.elem_type == TensorProto.FLOAT


def test_the_fp16_engine_generates_as_the_fp32_engine(fp16_engine, runtime_engine):
    """Same greedy tokens as the fp32 engine on a few prompts, confidences close."""
    _, _, fp32_dir = runtime_engine
    prompts = ["The river", "Bread is", "Stars at night"]
    fp32, fp16 = CalibratedLM.load(fp32_dir), CalibratedLM.load(fp16_engine.path)
    try:
        for prompt in prompts:
            a = fp32.generate(prompt, max_new_tokens=6)
            b = fp16.generate(prompt, max_new_tokens=6)
            assert [t.id for t in b.tokens] == [t.id for t in a.tokens]
            np.testing.assert_allclose([t.confidence for t in b.tokens],
                                       [t.confidence for t in a.tokens], atol=0.02)
    finally:
        fp32.close()
        fp16.close()


def test_a_failed_fp16_builder_graph_says_how_to_export_instead(runtime_engine, tmp_path,
                                                                monkeypatch):
    """The model was loaded in float16 for the builder: calm's own graph cannot take over from
    it, and the error says which flag does; nothing is written."""
    from calm_export.graphs import genai_builder
    from calm_runtime.errors import CalmError

    def broken(*_args, **_kwargs):
        raise genai_builder.BuilderError("onnxruntime-genai's builder failed (test)")

    monkeypatch.setattr(genai_builder, "_run_builder", broken)
    model_dir, adapter_dir, _ = runtime_engine
    with pytest.raises(CalmError, match="--graph fused"):
        export_engine(model_dir, tmp_path / "engine", adapter=adapter_dir,
                      config=ExportConfig(dtype="fp16", greedy_steps=4, progress=False))
    assert not (tmp_path / "engine").exists()


def test_float32_compute_of_a_half_model_is_the_float32_model_of_its_weights(runtime_engine,
                                                                             monkeypatch):
    model_dir, _, _ = runtime_engine
    half, _, _ = load_model_and_tokenizer(model_dir, dtype="float16")
    full, _, _ = load_model_and_tokenizer(model_dir, dtype="float32")
    with torch.no_grad():
        for p_full, p_half in zip(full.parameters(), half.parameters(), strict=True):
            p_full.copy_(p_half.float())  # the float16 weights, exactly, in float32
    monkeypatch.setattr(validate, "UPCAST_ROWS", 7)  # several blocks per Linear
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    before = [p.dtype for p in half.parameters()]
    with validate.float32_compute(half), torch.inference_mode():
        got = half(input_ids=ids).logits
    with torch.inference_mode():
        want = full(input_ids=ids).logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [p.dtype for p in half.parameters()] == before  # left as it was
    with torch.inference_mode():
        assert half(input_ids=ids).logits.dtype == torch.float16


@pytest.mark.parametrize("centered", [False, True])
def test_a_half_head_is_fused_in_float32_and_rounded_once(centered, monkeypatch):
    vocab, width = 50, 8
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, width, generator=generator)
    bias = torch.randn(vocab, generator=generator)
    adapter = _adapter(vocab, centered, np.random.default_rng(1))
    want_w, want_b = adapter.fused_head(weight.half().float(), bias.half().float())
    monkeypatch.setattr(fuse, "HALF_FUSE_ROWS", 16)
    got_w, got_b = fuse._fused_half_head(adapter, weight.half(), bias.half())
    assert got_w.dtype == torch.float16 and got_b.dtype == torch.float32
    torch.testing.assert_close(got_w, want_w.half(), atol=0, rtol=0)
    torch.testing.assert_close(got_b, want_b, atol=1e-6, rtol=1e-6)


def _adapter(vocab: int, centered: bool, rng) -> CalibrationAdapter:
    identity = ModelIdentity(name="toy", vocab_size=vocab, tokenizer_sha256="0" * 64)
    return CalibrationAdapter(base_model=identity,
                              tau=rng.uniform(0.5, 2.0, vocab).astype(np.float32),
                              shift=rng.normal(0, 0.3, vocab).astype(np.float32),
                              temperature=1.3, centered=centered)


def test_a_float16_graphs_logits_are_cast_to_float32_before_the_calibration(tmp_path):
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    vocab = 6
    weight = np.random.default_rng(0).normal(size=(4, vocab)).astype(np.float16)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["hidden", "head"], ["logits"])], "head",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT16, [1, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT16, [1, vocab])],
        [numpy_helper.from_array(weight, "head")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    hidden = np.ones((1, 4), np.float16)
    plain, calibrated = tmp_path / "plain.onnx", tmp_path / "calibrated.onnx"
    onnx.save_model(model, plain)
    onnx.save_model(model, calibrated)
    (head,) = ort.InferenceSession(str(plain)).run(None, {"hidden": hidden})
    assert head.dtype == np.float16
    scale = np.linspace(0.5, 1.5, vocab).astype(np.float32)
    shift = np.linspace(-1, 1, vocab).astype(np.float32)
    append_logits_affine(calibrated, scale, shift)
    (logits,) = ort.InferenceSession(str(calibrated)).run(None, {"hidden": hidden})
    assert logits.dtype == np.float32
    # within the head's float16 rounding (ONNX Runtime may drop a float16 round trip)
    np.testing.assert_allclose(logits, head.astype(np.float32) * scale + shift, rtol=2e-3,
                               atol=2e-3)
    append_logits_affine(plain, None, None)  # no calibration: still float32 logits
    (logits,) = ort.InferenceSession(str(plain)).run(None, {"hidden": hidden})
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, head.astype(np.float32), rtol=2e-3, atol=2e-3)
