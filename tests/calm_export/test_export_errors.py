"""Bad input and failed validation: one-line typed errors, nothing half-written."""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

from conftest import random_calibration_adapter  # noqa: E402

from calm_export import ExportConfig, export_engine, fuse, pipeline, validate  # noqa: E402
from calm_runtime.data.models import model_identity  # noqa: E402
from calm_runtime.errors import (  # noqa: E402
    ArtifactError,
    BackendUnavailableError,
    ConfigError,
    ExportValidationError,
    IncompatibleModelError,
    ModelSourceError,
)
from calm_runtime.files import sha256_file  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter, ModelIdentity  # noqa: E402
from calm_runtime.formats.engine import EngineManifest  # noqa: E402

FAST = {"progress": False, "exporter": "torchscript", "greedy_steps": 4}

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _one_line(info) -> str:
    message = str(info.value)
    assert message and "\n" not in message
    return message


def _nothing_written(parent, name="engine"):
    assert not (parent / name).exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def _no_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the cheap checks")
    monkeypatch.setattr(pipeline, "load_model_and_tokenizer", refuse)


def test_adapter_for_another_vocabulary_is_refused(tmp_path, tiny_llama_untied, monkeypatch):
    _no_load(monkeypatch)
    identity = model_identity(tiny_llama_untied)
    adapter = CalibrationAdapter(base_model=ModelIdentity("other", 200, identity.tokenizer_sha256),
                                 tau=np.ones(200), shift=np.zeros(200))
    with pytest.raises(IncompatibleModelError) as info:
        export_engine(tiny_llama_untied, tmp_path / "engine", adapter=adapter,
                      config=ExportConfig(**FAST))
    assert "200 tokens" in _one_line(info) and "300" in str(info.value)
    _nothing_written(tmp_path)


def test_adapter_for_another_tokenizer_is_refused(tmp_path, tiny_llama_untied, monkeypatch):
    _no_load(monkeypatch)
    identity = model_identity(tiny_llama_untied)
    adapter = CalibrationAdapter.identity(ModelIdentity(identity.name, 300, "f" * 64))
    with pytest.raises(IncompatibleModelError, match="tokenizer sha256") as info:
        export_engine(tiny_llama_untied, tmp_path / "engine", adapter=adapter,
                      config=ExportConfig(**FAST))
    _one_line(info)
    _nothing_written(tmp_path)


def test_existing_output_is_refused_at_once(tmp_path, tiny_llama_untied, monkeypatch):
    out = tmp_path / "engine"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _no_load(monkeypatch)
    with pytest.raises(ArtifactError, match="--overwrite") as info:
        export_engine(tiny_llama_untied, out, config=ExportConfig(**FAST))
    _one_line(info)
    with pytest.raises(ArtifactError, match="not a calm engine"):
        export_engine(tiny_llama_untied, out, config=ExportConfig(**FAST, overwrite=True))
    assert (out / "keep.txt").read_text() == "mine"


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None
                    and torch.cuda.is_available(), reason="TensorRT and a GPU are present")
def test_missing_tensorrt_fails_at_once_naming_the_extra(tmp_path, tiny_llama_untied,
                                                         monkeypatch):
    _no_load(monkeypatch)
    with pytest.raises(BackendUnavailableError) as info:
        export_engine(tiny_llama_untied, tmp_path / "engine",
                      config=ExportConfig(progress=False, format="tensorrt"))
    assert "pip install 'calm-llm[tensorrt]'" in _one_line(info)
    _nothing_written(tmp_path)


def test_unknown_model_is_a_model_source_error(tmp_path):
    with pytest.raises(ModelSourceError):
        export_engine(tmp_path / "no-such-model", tmp_path / "engine",
                      config=ExportConfig(progress=False))


def test_config_collects_every_problem_in_one_message():
    with pytest.raises(ConfigError) as info:
        ExportConfig(quantize="int3", opset=3, greedy_steps=0, head_layout="sideways")
    message = _one_line(info)
    for part in ("quantize", "opset", "greedy_steps", "head_layout"):
        assert part in message


def test_negative_tolerance_fails_validation_and_keeps_the_old_engine(
        tmp_path, tiny_llama_untied, monkeypatch):
    out = tmp_path / "engine"
    export_engine(tiny_llama_untied, out, config=ExportConfig(**FAST))
    before = {p.name: sha256_file(p) for p in out.iterdir()}
    monkeypatch.setattr(ExportConfig, "ATOL_FP32", -1.0)
    monkeypatch.setattr(ExportConfig, "RTOL_FP32", 0.0)
    with pytest.raises(ExportValidationError) as info:
        export_engine(tiny_llama_untied, out, config=ExportConfig(**FAST, overwrite=True))
    message = _one_line(info)
    assert "tolerance -1" in message and "no engine was written" in message
    assert {p.name: sha256_file(p) for p in out.iterdir()} == before
    EngineManifest.load(out)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".engine.")]


def test_corrupted_fused_head_is_caught(tmp_path, tiny_llama_tied, monkeypatch):
    real = fuse.fuse_into_lm_head

    def corrupted(model, adapter, *, layout="untied", multiplier=1.0):
        real(model, adapter, layout=layout, multiplier=multiplier)
        with torch.no_grad():
            model.get_output_embeddings().weight[17] *= 1.5
    monkeypatch.setattr(fuse, "fuse_into_lm_head", corrupted)
    adapter = random_calibration_adapter(tiny_llama_tied)
    with pytest.raises(ExportValidationError, match="fused torch model") as info:
        export_engine(tiny_llama_tied, tmp_path / "engine", adapter=adapter,
                      config=ExportConfig(**FAST))
    assert "max |logit diff|" in _one_line(info)
    _nothing_written(tmp_path)


def test_engine_differing_from_the_reference_writes_nothing(tmp_path, tiny_llama_untied,
                                                             monkeypatch):
    real = validate.onnx_runner

    def shifted(path, shape, providers=None):
        run, name = real(path, shape, providers)

        def run_shifted(*args):
            logits, state = run(*args)
            return logits + np.float32(0.5), state
        return run_shifted, name
    monkeypatch.setattr(validate, "onnx_runner", shifted)
    with pytest.raises(ExportValidationError, match="exported ONNX engine") as info:
        export_engine(tiny_llama_untied, tmp_path / "engine", config=ExportConfig(**FAST))
    assert "0.5" in _one_line(info)
    _nothing_written(tmp_path)


def test_broken_lora_folder_is_an_artifact_error(tmp_path, tiny_llama_untied):
    broken = tmp_path / "lora"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{}")
    adapter = random_calibration_adapter(tiny_llama_untied, lora_dir=broken)
    with pytest.raises(ArtifactError, match="LoRA") as info:
        export_engine(tiny_llama_untied, tmp_path / "engine", adapter=adapter,
                      config=ExportConfig(**FAST))
    _one_line(info)
    _nothing_written(tmp_path)


def test_dynamo_failure_falls_back_to_torchscript(tmp_path, tiny_llama_untied, monkeypatch):
    from calm_export.graphs import calm_graph

    def broken(*args, **kwargs):
        raise RuntimeError("torch.export cannot trace this model")
    monkeypatch.setattr(calm_graph, "_export_dynamo", broken)
    result = export_engine(tiny_llama_untied, tmp_path / "engine",
                           config=ExportConfig(progress=False, greedy_steps=4, graph="fused"))
    assert result.manifest.export["exporter_used"] == "torchscript"
    monkeypatch.setattr(calm_graph, "_export_torchscript", broken)
    with pytest.raises(calm_graph.OnnxExportError, match="dynamo: .*torchscript: ") as info:
        export_engine(tiny_llama_untied, tmp_path / "engine2",
                      config=ExportConfig(progress=False, greedy_steps=4, graph="fused"))
    _one_line(info)
    _nothing_written(tmp_path, "engine2")


def test_a_failing_builder_falls_back_to_calms_graph_unless_asked_for(tmp_path,
                                                                    tiny_llama_untied,
                                                                    monkeypatch):
    """--graph auto: when onnxruntime-genai's builder fails, the engine is calm's own graph
    and the manifest says why; --graph builder: a one-line error and nothing written."""
    from calm_export.graphs import genai_builder

    def broken(*args, **kwargs):
        raise genai_builder.BuilderError("onnxruntime-genai's builder failed (test)")
    monkeypatch.setattr(genai_builder, "_run_builder", broken)
    result = export_engine(tiny_llama_untied, tmp_path / "engine",
                           config=ExportConfig(progress=False, greedy_steps=4))
    graph = result.manifest.export["graph"]
    assert graph["kind"] == "ort-fused" and "builder failed (test)" in graph["builder_not_used"]
    assert not result.manifest.packed
    with pytest.raises(genai_builder.BuilderError, match="builder failed") as info:
        export_engine(tiny_llama_untied, tmp_path / "engine2",
                      config=ExportConfig(progress=False, greedy_steps=4, graph="builder"))
    _one_line(info)
    _nothing_written(tmp_path, "engine2")


# ------------------------------------------------- post-head transforms and --format hf
def test_an_unknown_transform_after_the_head_is_named(tmp_path, tiny_llama_untied,
                                                      monkeypatch):
    """A family that changes its logits after the head in a way calm does not know gets a
    one-line error that says so (not a parity mismatch), and nothing is written."""
    from transformers import LlamaForCausalLM

    real = LlamaForCausalLM.forward

    def squared(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        out.logits = out.logits * out.logits.abs()
        return out
    monkeypatch.setattr(LlamaForCausalLM, "forward", squared)
    adapter = random_calibration_adapter(tiny_llama_untied)
    adapter = dataclasses.replace(adapter, shift=np.zeros_like(adapter.shift))  # hf holds it
    for fmt in ("onnx", "hf"):
        with pytest.raises(ExportValidationError, match="transforms its logits after the LM "
                           "head") as info:
            export_engine(tiny_llama_untied, tmp_path / "engine", adapter=adapter,
                          config=ExportConfig(**FAST, format=fmt))
        assert "llama" in _one_line(info)
        _nothing_written(tmp_path)


def _tiny_phi_dir(tmp_path):
    from conftest import tiny_tokenizer
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    config = PhiConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                       bos_token_id=1, eos_token_id=2, pad_token_id=3)
    model = PhiForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.bias.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path / "phi")
    tiny_tokenizer().save_pretrained(tmp_path / "phi")
    return tmp_path / "phi"


def test_hf_checkpoint_holds_the_shift_where_the_head_has_a_bias(tmp_path):
    """Phi's head has a bias in transformers: b' = (b / tau + l) / T is loaded back."""
    from transformers import AutoModelForCausalLM

    folder = _tiny_phi_dir(tmp_path)
    adapter = random_calibration_adapter(folder)
    result = export_engine(folder, tmp_path / "hf", adapter=adapter,
                           config=ExportConfig(**FAST, format="hf"))
    assert result.manifest["calibration"]["folded"]["shift"] == "head bias"
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46, 47]])
    source = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.inference_mode():
        want = adapter.calibrate(source(input_ids=ids).logits.float())
        got = reloaded(input_ids=ids).logits.float()
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-4, rtol=0)
    # every file of the checkpoint is readable like the rest of an artifact (0644)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert set(modes.values()) == {0o644}, modes
    # it says which outputs it calibrates: token logprobs (folded); options need calm
    outputs = result.manifest["calibration"]["outputs"]
    assert outputs["token_logprobs"] and outputs["option_probabilities"] is None


def test_serving_an_hf_checkpoint_points_to_calm_export(tmp_path):
    from calm_runtime.errors import ArtifactError
    from calm_runtime.formats.engine import EngineManifest

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ArtifactError, match="transformers model folder.*calm-export --model"):
        EngineManifest.load(folder)
    (folder / "calm_checkpoint.json").write_text("{}")
    with pytest.raises(ArtifactError, match="calibrated transformers checkpoint.*--format onnx"):
        EngineManifest.load(folder)


def test_cli_gives_one_line_where_the_checkpoint_cannot_hold_the_shift(tmp_path,
                                                                       tiny_llama_untied,
                                                                       capsys):
    from calm_export.cli import main

    adapter_dir = tmp_path / "adapter"
    random_calibration_adapter(tiny_llama_untied).save_pretrained(adapter_dir)
    rc = main(["--model", str(tiny_llama_untied), "--adapter", str(adapter_dir), "--format",
               "hf", "--out", str(tmp_path / "engine"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith("IncompatibleModelError: ") and "no bias" in err[0]
    _nothing_written(tmp_path)


def test_hf_format_refuses_settings_it_cannot_honour():
    for bad in ({"dtype": "fp16"}, {"quantize": "int8"}, {"head_layout": "tied-scale"}):
        with pytest.raises(ConfigError, match="--format hf"):
            ExportConfig(format="hf", **bad)


def test_logits_to_keep_needs_a_recognisable_head(tmp_path):
    """A graph whose logits do not come from a MatMul by a [*, vocab] weight (through
    elementwise ops only) is refused with one line, and the file is left as it was."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from calm_export.graphs.calm_graph import OnnxExportError, add_logits_to_keep

    weight = numpy_helper.from_array(np.ones((4, 10), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"],
                                                                           ["logits"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 3, 10])], [weight])
    path = tmp_path / "model.onnx"
    onnx.save_model(helper.make_model(graph), str(path))
    before = path.read_bytes()
    with pytest.raises(OnnxExportError, match="cannot find the LM head") as info:
        add_logits_to_keep(path, 10)
    assert "\n" not in str(info.value) and path.read_bytes() == before


def test_handlers_the_builder_attached_to_its_log_are_dropped():
    """A library that configured logging while the builder's output went to its log file
    leaves a handler on that file; calm removes it before the file closes, so later log
    records do not fail with 'I/O operation on closed file'."""
    import io
    import logging

    from calm_export.graphs.genai_builder import _drop_handlers_on

    sink, other = io.StringIO(), io.StringIO()
    library = logging.getLogger("some.builder.library")
    on_sink, on_other = logging.StreamHandler(sink), logging.StreamHandler(other)
    library.addHandler(on_sink)
    logging.getLogger().addHandler(on_other)
    try:
        _drop_handlers_on(sink)
        assert on_sink not in library.handlers
        assert on_other in logging.getLogger().handlers
    finally:
        library.removeHandler(on_sink)
        logging.getLogger().removeHandler(on_other)
