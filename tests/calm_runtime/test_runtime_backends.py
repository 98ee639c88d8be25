"""Every available backend agrees with the ONNX Runtime backend (tolerance table below),
and each backend fails with a one-line typed error where it cannot run."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from calm_runtime import CalibratedLM  # noqa: E402
from calm_runtime.errors import (  # noqa: E402
    BackendUnavailableError,
    ConfigError,
    IncompatibleModelError,
)

#: |backend - onnxruntime| allowed, per quantity. The torch backend runs the source model
#: (LoRA merged) with the calibration formula on its logits, the engine the fused graph;
#: both are float32 and agree to ~1e-5 on logits here. TensorRT fp16 plans would need the
#: fp16 row (ExportConfig.ATOL_FP16 on logits; probabilities move by ~1e-2).
TOLERANCE = {
    "torch": {"confidence": 2e-4, "logprob": 2e-3, "probabilities": 2e-4, "scores": 1e-3},
    "tensorrt": {"confidence": 2e-2, "logprob": 5e-2, "probabilities": 2e-2, "scores": 5e-2},
}
PROMPTS = ["Question: What is the capital of France?\nAnswer:", "Hi",
           "Question: Which planet is known as the red planet?\nAnswer:"]
QUESTIONS = [("Which number is prime?", ["4", "7", "9"]),
             ("Where do penguins live?", ["the Arctic", "Antarctica", "the Sahara", "Paris"])]


@pytest.fixture(scope="module")
def baseline(runtime_engine):
    return CalibratedLM.load(runtime_engine[2], backend="onnxruntime", threads=1)


@pytest.fixture(scope="module", params=["torch", "tensorrt"])
def other(request, runtime_engine, tmp_path_factory):
    model_dir, adapter_dir, engine_dir = runtime_engine
    if request.param == "torch":
        return request.param, CalibratedLM.load(engine_dir, backend="torch", model=model_dir,
                                                adapter=adapter_dir)
    from calm_export.config import ExportConfig
    from calm_export.pipeline import export_engine
    from calm_export.tensorrt import require_tensorrt

    try:
        require_tensorrt()
    except BackendUnavailableError as exc:
        pytest.skip(f"TensorRT unavailable here: {exc}")
    plan_dir = tmp_path_factory.mktemp("runtime-trt") / "engine"
    export_engine(model_dir, plan_dir, adapter=adapter_dir,
                  config=ExportConfig(format="tensorrt", greedy_steps=4, progress=False,
                                      exporter="torchscript", max_sequence_length=256))
    return request.param, CalibratedLM.load(plan_dir, backend="tensorrt")


def _close(name, got, want, tol, what):
    diff = float(np.max(np.abs(np.asarray(got) - np.asarray(want))))
    assert diff <= tol, f"{name}: {what} differs from onnxruntime by {diff:.3g} > {tol}"


@pytest.mark.parametrize("options", [{}, {"temperature": 0.9, "top_k": 40, "seed": 4}])
def test_generation_agrees(baseline, other, options):
    name, lm = other
    tol = TOLERANCE[name]
    for got, want in zip(lm.generate(PROMPTS, max_new_tokens=8, **options),
                         baseline.generate(PROMPTS, max_new_tokens=8, **options), strict=True):
        assert got.token_ids == want.token_ids, f"{name}: tokens differ"
        _close(name, [t.confidence for t in got.tokens], [t.confidence for t in want.tokens],
               tol["confidence"], "confidence")
        _close(name, [t.logprob for t in got.tokens], [t.logprob for t in want.tokens],
               tol["logprob"], "logprob")
        assert got.text == want.text and got.finish_reason == want.finish_reason


def test_streaming_agrees(baseline, other):
    name, lm = other
    got = [t.id for t in lm.stream(PROMPTS[0], max_new_tokens=6)]
    assert got == baseline.generate(PROMPTS[0], max_new_tokens=6).token_ids


@pytest.mark.parametrize("mode", ["cloze", "letter"])
def test_choices_agree(baseline, other, mode):
    name, lm = other
    questions, options = [q for q, _ in QUESTIONS], [o for _, o in QUESTIONS]
    for got, want in zip(lm.choose_batch(questions, options, mode),
                         baseline.choose_batch(questions, options, mode), strict=True):
        _close(name, got.scores, want.scores, TOLERANCE[name]["scores"], f"{mode} scores")
        _close(name, got.probabilities, want.probabilities, TOLERANCE[name]["probabilities"],
               f"{mode} probabilities")


def test_p_true_agrees(baseline, other):
    name, lm = other
    questions, answers = ["What is 2 + 2?", "Who wrote Hamlet?"], ["4", "Dickens"]
    _close(name, lm.p_true_batch(questions, answers), baseline.p_true_batch(questions, answers),
           TOLERANCE[name]["probabilities"], "P(True)")


# ---------------------------------------------------------------------- backend errors
def test_torch_backend_needs_the_engines_adapter(runtime_engine, tmp_path):
    from calm_runtime.data.models import model_identity
    from calm_runtime.formats.artifact import CalibrationAdapter

    model_dir, _, engine_dir = runtime_engine
    with pytest.raises(ConfigError, match="pass adapter=PATH"):
        CalibratedLM.load(engine_dir, backend="torch", model=model_dir)
    other = CalibrationAdapter.identity(model_identity(model_dir))
    other.save_pretrained(tmp_path / "identity")
    with pytest.raises(IncompatibleModelError, match="not the one the engine was exported"):
        CalibratedLM.load(engine_dir, backend="torch", model=model_dir,
                          adapter=tmp_path / "identity")
    with pytest.raises(ConfigError, match="pass model=PATH"):
        CalibratedLM.load(engine_dir, backend="torch", adapter=runtime_engine[1])


def test_tensorrt_backend_refuses_an_onnx_engine(runtime_engine):
    with pytest.raises(BackendUnavailableError) as info:
        CalibratedLM.load(runtime_engine[2], backend="tensorrt")
    assert "kind 'onnx'" in str(info.value) and "\n" not in str(info.value)


def test_unknown_backend_and_provider_options(runtime_engine):
    with pytest.raises(ConfigError, match="unknown backend"):
        CalibratedLM.load(runtime_engine[2], backend="tflite")
    with pytest.raises(ConfigError, match="providers only applies"):
        CalibratedLM.load(runtime_engine[2], backend="torch", providers=["cuda"])


def test_a_missing_gpu_provider_is_an_error(runtime_engine):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA; the fallback test below covers it")
    with pytest.raises(BackendUnavailableError, match="not in this onnxruntime build"):
        CalibratedLM.load(runtime_engine[2], providers=["cuda", "cpu"])


def test_a_silent_cpu_fallback_is_an_error(runtime_engine, monkeypatch):
    """onnxruntime-gpu without CUDA libraries creates a CPU session and only logs; calm raises."""
    import onnxruntime as ort

    real = ort.InferenceSession

    class FallbackSession(real):
        def __init__(self, path, options=None, providers=None, provider_options=None, **kw):
            super().__init__(path, options, providers=["CPUExecutionProvider"], **kw)

    monkeypatch.setattr(ort, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(ort, "InferenceSession", FallbackSession)
    with pytest.raises(BackendUnavailableError) as info:
        CalibratedLM.load(runtime_engine[2], providers=["cuda", "cpu"])
    message = str(info.value)
    assert "CUDAExecutionProvider was requested but onnxruntime runs on" in message
    assert "\n" not in message


@pytest.mark.gpu
def test_cuda_provider_agrees_with_cpu(runtime_engine, baseline):
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs onnxruntime-gpu with a CUDA GPU")
    lm = CalibratedLM.load(runtime_engine[2], providers=["cuda"])
    assert lm.backend.device.startswith("cuda")
    for got, want in zip(lm.generate(PROMPTS, max_new_tokens=8),
                         baseline.generate(PROMPTS, max_new_tokens=8), strict=True):
        assert got.token_ids == want.token_ids
        _close("cuda", [t.confidence for t in got.tokens],
               [t.confidence for t in want.tokens], 1e-3, "confidence")


def _cache(state) -> list:
    """The KV cache's used entries: every layer's arrays, or a packed engine's buffer slots
    each row has filled."""
    if hasattr(state, "lengths"):
        return [array[b, :, :n] for array in state.arrays
                for b, n in enumerate(state.lengths)]
    return [value.numpy() for value in state]


def test_last_position_logits_equal_the_full_projection(runtime_engine, tmp_path):
    """The engine's optional ``logits_to_keep`` input: a prefill that needs only the last
    position projects only it, and its logits equal the last row of the full projection;
    an engine without the input (exported before it existed) prefills the same."""
    import onnx
    import onnxruntime as ort

    from calm_runtime.formats.engine import EngineManifest
    from calm_runtime.inference.backends._onnxruntime import OnnxRuntimeBackend

    manifest = EngineManifest.load(runtime_engine[2])
    backend = OnnxRuntimeBackend(manifest, threads=1)
    assert backend.keeps_logits and manifest.export["logits_to_keep"] is True
    session = ort.InferenceSession(str(manifest.path("model.onnx")),
                                   providers=["CPUExecutionProvider"])
    assert "logits_to_keep" not in {i.name for i in session.get_inputs()}  # optional for peers
    rng = np.random.default_rng(0)
    ids = rng.integers(3, manifest.vocab_size, size=(2, 9))
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    full, full_state = backend.run(ids, mask, positions)
    last, last_state = backend.run(ids, mask, positions, last_only=True)
    assert full.shape[1] == 9 and last.shape[1] == 1
    np.testing.assert_allclose(last[:, 0], full[:, -1], atol=1e-5, rtol=0)
    for a, b in zip(_cache(full_state), _cache(last_state), strict=True):
        np.testing.assert_array_equal(a, b)
    # a decode step on the cache of the keep-1 prefill equals one on the full prefill's
    step = (ids[:, :1], np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1),
            positions[:, -1:] + 1)
    np.testing.assert_array_equal(backend.run(*step, last_state)[0],
                                  backend.run(*step, full_state)[0])

    old = onnx.load(str(manifest.path("model.onnx")))
    keep_nodes = [n for n in old.graph.node if n.name.startswith("logits_to_keep")]
    assert [n.op_type for n in keep_nodes] == ["Neg", "Slice"]
    head = next(n for n in old.graph.node if keep_nodes[1].output[0] in n.input)
    head.input[0] = keep_nodes[1].input[0]
    for node in keep_nodes:
        old.graph.node.remove(node)
    for container in (old.graph.input, old.graph.initializer):
        for value in [v for v in container if v.name.startswith("logits_to_keep")]:
            container.remove(value)
    onnx.save_model(old, str(tmp_path / "model.onnx"))
    plain = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    backend._session = plain
    backend.keeps_logits = False
    backend.max_logits_bytes = 4 * 2 * manifest.vocab_size * 4  # chunks of 4 positions
    chunked, _ = backend.run(ids, mask, positions, last_only=True)
    np.testing.assert_allclose(chunked, last, atol=1e-5, rtol=0)
