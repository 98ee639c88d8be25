"""An export whose memory is the model's: checkpoints converted one tensor at a time, the
torch model dropped before the builder reads its copy (written in the checkpoint's own
precision where that is exact), each stage's peak in the manifest. The sizes themselves are
measured by benchmarks/scale.py; these tests hold the mechanisms to their results."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime_genai")

from conftest import random_calibration_adapter, tiny_llama_config, tiny_tokenizer  # noqa: E402

from calm_export import ExportConfig, export_engine  # noqa: E402

FAST = {"progress": False, "greedy_steps": 4}
NARROWED = "the builder reads the weights in the checkpoint's bfloat16"


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def bf16_llama(request, tmp_path_factory):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tied=request.param)).eval().to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("bf16-llama")
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_a_converted_checkpoint_is_the_one_transformers_loads(bf16_llama):
    import torch
    from transformers import AutoModelForCausalLM

    from calm_runtime.data.models import load_model_and_tokenizer

    mine, _, _ = load_model_and_tokenizer(bf16_llama, dtype="float32", device="cpu")
    theirs = AutoModelForCausalLM.from_pretrained(str(bf16_llama), dtype=torch.float32).eval()
    a, b = mine.state_dict(), theirs.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(x, y) for x, y in zip(mine.buffers(), theirs.buffers(), strict=True))
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        assert torch.equal(mine(input_ids=ids).logits, theirs(input_ids=ids).logits)
    assert (mine.get_output_embeddings().weight is mine.get_input_embeddings().weight) == (
        theirs.get_output_embeddings().weight is theirs.get_input_embeddings().weight)


def test_the_builder_reads_the_checkpoints_precision_only_where_exact(bf16_llama, tmp_path,
                                                                     caplog):
    caplog.set_level(logging.INFO, logger="calm_export")
    plain = export_engine(bf16_llama, tmp_path / "plain", config=ExportConfig(**FAST))
    assert NARROWED in caplog.text
    assert plain.manifest.export["graph"]["kind"] == "genai-builder"
    assert plain.manifest.validation["passed"]
    stages = plain.manifest.export["stages"]
    assert {"load", "reference", "export", "validate"} <= set(stages["peak_rss_mb"])
    assert all(v > 0 for v in stages["peak_rss_mb"].values())
    assert set(stages["peak_rss_mb"]) <= set(plain.peak_rss_mb)  # what calm-export prints
    caplog.clear()
    # a per-token tau: W / (tau T) is no bfloat16 number, the builder reads float32
    calibrated = export_engine(bf16_llama, tmp_path / "calibrated",
                               adapter=random_calibration_adapter(bf16_llama),
                               config=ExportConfig(**FAST))
    assert NARROWED not in caplog.text
    assert calibrated.manifest.validation["passed"]


def test_narrowing_leaves_a_model_with_one_inexact_weight_as_it_was(tiny_llama_untied):
    import torch

    from calm_export.graphs.genai_builder import _narrow_exactly
    from calm_runtime.data.models import load_model_and_tokenizer

    model, _, _ = load_model_and_tokenizer(tiny_llama_untied, dtype="float32", device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert not _narrow_exactly(model, "bfloat16")  # random float32 weights are not bf16
    after = model.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], before[k])
               for k in before)


def test_an_fp16_engine_past_protobufs_limit_is_converted_from_the_file(tiny_llama_untied,
                                                                        tmp_path, monkeypatch):
    """A float32 graph past protobuf's 2 GB cannot be serialised whole for shape inference
    (a 566M model's fp16 export died there): its shapes are inferred from the file and the
    conversion does not infer again (calm's own graph). Here the limit is lowered so a tiny
    graph takes that path; the fp16 engine must still pass its validation."""
    import onnx.shape_inference

    from calm_export import quantize

    calls = []
    original = onnx.shape_inference.infer_shapes_path

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes_path", spy)
    monkeypatch.setattr(quantize, "PROTOBUF_LIMIT", 0)
    # calm's own graph: the builder's fp16 engine is built from float16 weights, no conversion
    result = export_engine(tiny_llama_untied, tmp_path / "fp16",
                           config=ExportConfig(**FAST, dtype="fp16", graph="fused"))
    assert calls  # the file-based inference ran
    assert result.manifest.model["dtype"] == "float16"
    assert result.manifest.validation["passed"]
