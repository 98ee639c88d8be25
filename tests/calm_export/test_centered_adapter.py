"""Centred logits (docs/methods.md §1): ``((z − mean_v z) / τ + l) / T``.

The identity stays the identity; the fused head ``W' = (W − 1·w̄ᵀ)/(τT)``,
``b' = ((b − b̄)/τ + l)/T`` equals the formula; the adapter records it; and the exported
engine (calm's graph, both head layouts), the ``--format hf`` checkpoint and the runtime's
torch backend all give the formula's logits.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from conftest import random_calibration_adapter  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from calm_export import (  # noqa: E402
    ExportConfig,
    export_engine,
    fuse,  # noqa: E402
)
from calm_runtime.calibration import apply_calibration, fused_head  # noqa: E402
from calm_runtime.errors import ArtifactError  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter, ModelIdentity  # noqa: E402
from calm_runtime.formats.engine import EngineManifest  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_single_thread")
#: the fused head against the formula, float32 (the acceptance bound of the issue)
ATOL = 1e-5


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_centering_changes_nothing_at_the_identity_and_something_otherwise():
    rng = np.random.default_rng(0)
    z = rng.normal(40.0, 3.0, (5, 50))  # a large common offset, as real raw logits have
    centred = apply_calibration(z, center=True)
    np.testing.assert_allclose(_log_softmax(centred), _log_softmax(z), atol=1e-12)
    np.testing.assert_allclose(centred.mean(-1), 0.0, atol=1e-9)
    tau = np.exp(rng.normal(0.0, 0.2, 50))
    raw = _log_softmax(apply_calibration(z, tau))
    around_mean = _log_softmax(apply_calibration(z, tau, center=True))
    # a per-token temperature on raw logits moves tokens by z_v (1/τ_v − 1): tens of nats here
    assert np.abs(raw - _log_softmax(z)).max() > 5 * np.abs(around_mean - _log_softmax(z)).max()


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_fused_centred_head_equals_the_formula(with_bias, backend):
    rng = np.random.default_rng(1)
    vocab, d = 64, 16
    weight = rng.normal(0, 1, (vocab, d)).astype(np.float32)
    bias = rng.normal(0, 1, vocab).astype(np.float32) if with_bias else None
    tau = np.exp(rng.normal(0, 0.3, vocab)).astype(np.float32)
    shift = rng.normal(0, 0.5, vocab).astype(np.float32)
    h = rng.normal(0, 1, (7, d)).astype(np.float32)
    cast = (lambda a: a) if backend == "numpy" else (
        lambda a: None if a is None else torch.from_numpy(a))
    w2, b2 = fused_head(cast(weight), cast(bias), cast(tau), cast(shift), 1.3, center=True)
    z = h @ weight.T + (0 if bias is None else bias)
    expected = apply_calibration(z, tau, shift, 1.3, center=True)
    got = np.asarray(cast(h) @ w2.T + b2)
    assert np.abs(got - expected).max() < ATOL


def test_the_adapter_records_centring_and_refuses_a_bad_value(tmp_path):
    identity = ModelIdentity("tiny", 8)
    rng = np.random.default_rng(2)
    adapter = CalibrationAdapter(base_model=identity, tau=np.exp(rng.normal(0, .2, 8)),
                                 shift=np.zeros(8), centered=True, kind="calm")
    adapter.save_pretrained(tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / "calm_adapter.json").read_text())
    assert manifest["logits"] == "centered"
    loaded = CalibrationAdapter.from_pretrained(tmp_path / "c")
    assert loaded.centered
    z = rng.normal(30, 2, (3, 8)).astype(np.float32)
    np.testing.assert_allclose(loaded.calibrate(z), apply_calibration(
        z, loaded.tau, loaded.shift, center=True), rtol=1e-6)
    raw = dataclasses.replace(adapter, centered=False)
    raw.save_pretrained(tmp_path / "r")
    assert "logits" not in json.loads((tmp_path / "r" / "calm_adapter.json").read_text())
    assert not CalibrationAdapter.from_pretrained(tmp_path / "r").centered
    manifest["logits"] = "median"
    (tmp_path / "c" / "calm_adapter.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="logits must be"):
        CalibrationAdapter.from_pretrained(tmp_path / "c")


def _centred(model_dir, seed=3):
    return dataclasses.replace(random_calibration_adapter(model_dir, seed=seed), centered=True)


def _ids():
    return torch.randint(4, 300, (2, 9), generator=torch.Generator().manual_seed(0))


def _formula(model_dir, adapter, ids):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        return adapter.calibrate(model(input_ids=ids).logits).numpy()


@pytest.mark.parametrize("layout", ["untied", "tied-scale"])
def test_fused_torch_layouts_equal_the_formula(tiny_llama_tied, layout):
    adapter = _centred(tiny_llama_tied)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_tied)).eval()
    if layout == "untied":
        fuse.untie_lm_head(model)
    fuse.fuse_into_lm_head(model, adapter, layout=layout)
    ids = _ids()
    with torch.no_grad():
        got = model(input_ids=ids).logits.numpy()
    expected = _formula(tiny_llama_tied, adapter, ids)
    assert np.abs(got - expected).max() < 1e-4
    # and it is not the raw-logit transform
    raw = _formula(tiny_llama_tied, dataclasses.replace(adapter, centered=False), ids)
    assert np.abs(_log_softmax(got) - _log_softmax(raw)).max() > 1e-3


def test_logits_affine_centres_after_the_head(tiny_llama_untied):
    adapter = _centred(tiny_llama_untied, seed=4)
    z = torch.randn(2, 3, adapter.base_model.vocab_size) + 20.0
    got = fuse.logits_affine(adapter, adapter.base_model.vocab_size)(z)
    assert float((got - adapter.calibrate(z)).abs().max()) < 1e-4


def test_engine_checkpoint_and_torch_backend_agree_with_the_formula(tmp_path,
                                                                    tiny_llama_untied):
    """calm's own graph (ONNX Runtime), the --format hf checkpoint and the runtime's torch
    backend: three routes, one formula."""
    from calm_runtime.inference.backends import OnnxRuntimeBackend, TorchBackend

    adapter = _centred(tiny_llama_untied, seed=5)
    adapter.save_pretrained(tmp_path / "adapter")
    ids = _ids()
    expected = _formula(tiny_llama_untied, adapter, ids)
    engine = export_engine(tiny_llama_untied, tmp_path / "engine", adapter=tmp_path / "adapter",
                           config=ExportConfig(progress=False, graph="fused"))
    manifest = EngineManifest.load(engine.path)
    ids_np = ids.numpy()
    mask = np.ones_like(ids_np)
    positions = np.broadcast_to(np.arange(ids_np.shape[1]), ids_np.shape).copy()
    onnx_logits, _ = OnnxRuntimeBackend(manifest, threads=1).run(ids_np, mask, positions)
    assert np.abs(onnx_logits - expected).max() < 1e-3
    torch_logits, _ = TorchBackend(manifest, model=str(tiny_llama_untied),
                                   adapter=tmp_path / "adapter").run(ids_np, mask, positions)
    assert np.abs(torch_logits - expected).max() < 1e-4
    # a Llama head has no bias in transformers: the checkpoint holds τ and T (centred), not l
    tau_only = dataclasses.replace(adapter, shift=np.zeros_like(adapter.shift))
    hf = export_engine(tiny_llama_untied, tmp_path / "hf", adapter=tau_only,
                       config=ExportConfig(progress=False, format="hf"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(hf.path)).eval()
    with torch.no_grad():
        hf_logits = reloaded(input_ids=ids).logits.numpy()
    assert np.abs(hf_logits - _formula(tiny_llama_untied, tau_only, ids)).max() < 1e-4
