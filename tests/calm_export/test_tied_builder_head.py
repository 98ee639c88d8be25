"""The builder route keeps a tied head where tau is one number (issue 40, item 5): the
engine is the builder's own graph with ``* 1/(tau T) + shift`` after its shared head, no
larger than the builder's, and its logits are the calibration formula's. A per-token tau
still unties (``W / tau`` is a new matrix)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime_genai")

from transformers import AutoModelForCausalLM  # noqa: E402

from calm_export import ExportConfig, export_engine  # noqa: E402
from calm_runtime.calibration import apply_calibration  # noqa: E402
from calm_runtime.data.models import model_identity  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter  # noqa: E402
from calm_runtime.formats.engine import EngineManifest  # noqa: E402
from calm_runtime.inference.backends import OnnxRuntimeBackend  # noqa: E402


def _adapter(folder, tau, shift, temperature):
    identity = model_identity(folder)
    return CalibrationAdapter(base_model=identity, tau=tau.astype(np.float32),
                              shift=shift.astype(np.float32), temperature=temperature,
                              answer_temperature=None, kind="daca", method={"mode": "letter"})


def _engine_logits(engine, ids):
    manifest = EngineManifest.load(engine)
    mask = np.ones_like(ids)
    positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy()
    logits, _ = OnnxRuntimeBackend(manifest, threads=1).run(ids, mask, positions)
    return manifest, logits


def _formula(folder, adapter, ids):
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        z = model(input_ids=torch.from_numpy(ids)).logits.numpy()
    return apply_calibration(z, adapter.tau, adapter.shift, adapter.temperature)


def _size(folder):
    return sum(p.stat().st_size for p in folder.glob("model.onnx*"))


def test_a_scalar_temperature_keeps_the_builders_tied_head(tmp_path, tiny_llama_tied):
    vocab = model_identity(tiny_llama_tied).vocab_size
    rng = np.random.default_rng(0)
    scalar = _adapter(tiny_llama_tied, np.ones(vocab), rng.normal(0, 0.3, vocab), 1.7)
    scalar.save_pretrained(tmp_path / "scalar")
    per_token = _adapter(tiny_llama_tied, np.exp(rng.normal(0, 0.2, vocab)), np.zeros(vocab),
                         1.7)
    per_token.save_pretrained(tmp_path / "per-token")
    ids = rng.integers(0, vocab, (2, 9))

    tied = export_engine(tiny_llama_tied, tmp_path / "tied", adapter=tmp_path / "scalar",
                         config=ExportConfig(progress=False, graph="builder")).path
    manifest, logits = _engine_logits(tied, ids)
    graph = manifest.export["graph"]
    assert graph["kind"] == "genai-builder"
    assert graph["calibration_after_head"] == ["scale", "shift"]
    assert np.abs(logits - _formula(tiny_llama_tied, scalar, ids)).max() < 1e-4

    untied = export_engine(tiny_llama_tied, tmp_path / "untied", adapter=tmp_path / "per-token",
                           config=ExportConfig(progress=False, graph="builder")).path
    manifest, logits = _engine_logits(untied, ids)
    assert manifest.export["graph"]["calibration_after_head"] == []
    assert np.abs(logits - _formula(tiny_llama_tied, per_token, ids)).max() < 1e-4
    # the tied engine holds the embedding once: smaller by about one [V, d] matrix
    hidden = AutoModelForCausalLM.from_pretrained(str(tiny_llama_tied)).config.hidden_size
    assert _size(untied) - _size(tied) >= 0.9 * vocab * hidden * 4
