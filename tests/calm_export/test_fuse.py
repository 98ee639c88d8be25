"""Merge + untie + fuse in torch (export/fuse.py): the fused head equals the formula."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from conftest import random_calibration_adapter  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from calm_export import fuse  # noqa: E402
from calm_runtime.calibration import apply_calibration  # noqa: E402
from calm_runtime.errors import ArtifactError, IncompatibleModelError  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter, ModelIdentity  # noqa: E402

#: fp32 on 2 tiny layers: the fused matmul rounds differently from matmul-then-scale by
#: a few ulps of logits of magnitude ~5, i.e. ~1e-6; 1e-5 leaves room and still catches
#: any missing factor (a wrong T or tau moves logits by >= 1e-2).
FUSE_ATOL = 1e-5

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _ids():
    generator = torch.Generator().manual_seed(0)
    return torch.randint(4, 300, (2, 9), generator=generator)


def _load(model_dir):
    return AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()


def _reference_logits(model_dir, adapter, ids):
    """Unfused model (+ unmerged LoRA), calibration applied with the formula module."""
    model = _load(model_dir)
    if adapter.lora_path is not None:
        model = fuse.apply_lora(model, adapter.lora_path)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return apply_calibration(logits, torch.from_numpy(adapter.tau),
                             torch.from_numpy(adapter.shift), adapter.temperature)


def _fused_model(model_dir, adapter, layout="untied"):
    model = _load(model_dir)
    if layout == "untied":
        fuse.untie_lm_head(model)
    if adapter.lora_path is not None:
        model = fuse.merge_lora(fuse.apply_lora(model, adapter.lora_path))
    fuse.fuse_into_lm_head(model, adapter, layout=layout)
    return model


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("with_lora", [True, False])
def test_fused_torch_equals_formula(request, tied, with_lora):
    model_dir = request.getfixturevalue("tiny_llama_tied" if tied else "tiny_llama_untied")
    lora = request.getfixturevalue("tiny_lora_tied" if tied else "tiny_lora_untied")
    adapter = random_calibration_adapter(model_dir, lora_dir=lora if with_lora else None)
    ids = _ids()
    reference = _reference_logits(model_dir, adapter, ids)
    model = _fused_model(model_dir, adapter)
    with torch.no_grad():
        fused = model(input_ids=ids).logits
    diff = float((fused - reference).abs().max())
    assert diff < FUSE_ATOL, f"fused head differs from the formula by {diff:.3g}"
    with torch.no_grad():
        uncalibrated = _load(model_dir)(input_ids=ids).logits
    assert float((fused - uncalibrated).abs().max()) > 1e-2  # the calibration did something


def test_untie_keeps_the_embedding_and_the_merge_matters(tiny_llama_tied, tiny_lora_tied):
    original = _load(tiny_llama_tied)
    embedding = original.get_input_embeddings().weight.detach().clone()
    adapter = random_calibration_adapter(tiny_llama_tied, lora_dir=tiny_lora_tied)
    model = _fused_model(tiny_llama_tied, adapter)
    assert not fuse.head_is_tied(model)
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    head = model.get_output_embeddings()
    expected_weight, expected_bias = adapter.fused_head(embedding)
    assert torch.allclose(head.weight, expected_weight) and head.bias is not None
    assert torch.allclose(head.bias, expected_bias)
    q_before = original.model.layers[0].self_attn.q_proj.weight
    q_after = model.model.layers[0].self_attn.q_proj.weight
    assert float((q_after - q_before).abs().max()) > 1e-3  # the LoRA was merged


def test_tied_scale_layout_keeps_the_tie_and_equals_formula(tiny_llama_tied):
    adapter = random_calibration_adapter(tiny_llama_tied)
    ids = _ids()
    reference = _reference_logits(tiny_llama_tied, adapter, ids)
    model = _fused_model(tiny_llama_tied, adapter, layout="tied-scale")
    assert isinstance(model.get_output_embeddings(), fuse.ScaledHead)
    assert fuse.head_is_tied(model)
    with torch.no_grad():
        fused = model(input_ids=ids).logits
    assert float((fused - reference).abs().max()) < FUSE_ATOL


def test_identity_adapter_changes_nothing(tiny_llama_untied):
    model = _load(tiny_llama_untied)
    ids = _ids()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    identity = CalibrationAdapter.identity(ModelIdentity("tiny", 300))
    fuse.fuse_into_lm_head(model, identity)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert float((after - before).abs().max()) < 1e-6


def test_fusing_into_a_tied_head_is_refused(tiny_llama_tied):
    model = _load(tiny_llama_tied)
    adapter = random_calibration_adapter(tiny_llama_tied)
    with pytest.raises(ArtifactError, match="untie_lm_head"):
        fuse.fuse_into_lm_head(model, adapter, layout="untied")


def test_vocabulary_mismatch_is_refused(tiny_llama_untied):
    model = _load(tiny_llama_untied)
    small = CalibrationAdapter(base_model=ModelIdentity("other", 100),
                               tau=np.ones(100), shift=np.zeros(100))
    with pytest.raises(IncompatibleModelError, match="100 tokens"):
        fuse.fuse_into_lm_head(model, small)
