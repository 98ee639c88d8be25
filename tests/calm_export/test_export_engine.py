"""End to end on tiny random Llamas: export_engine -> ONNX Runtime / onnxruntime-genai.

The parity check here is written independently of export/validate.py: the unfused model
(+ unmerged LoRA) generates greedily with its KV cache, the formula is applied in torch,
and the engine replays the same tokens through ONNX Runtime with explicit past tensors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from conftest import genai_greedy, random_calibration_adapter  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

from calm_export import ExportConfig, export_engine  # noqa: E402
from calm_runtime.calibration import apply_calibration  # noqa: E402
from calm_runtime.data.models import model_identity  # noqa: E402
from calm_runtime.files import sha256_file  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter  # noqa: E402
from calm_runtime.formats.engine import EngineManifest  # noqa: E402

STEPS = 20
#: fp32 ONNX Runtime vs torch on 2 tiny layers differ by ~1e-6 on logits of magnitude ~5.
ENGINE_ATOL = 1e-4
PROMPTS = ["Question: Is the sky blue?\nAnswer:", "Hi", "The proposed answer is: (A) True"]

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(scope="module")
def tied_lora_engine(tmp_path_factory, tiny_llama_tied, tiny_lora_tied):
    """Tied head + LoRA, adapter from a directory, default settings (the builder graph)."""
    root = tmp_path_factory.mktemp("tied-lora")
    adapter = random_calibration_adapter(tiny_llama_tied, lora_dir=tiny_lora_tied)
    adapter.save_pretrained(root / "adapter")
    result = export_engine(tiny_llama_tied, root / "engine", adapter=root / "adapter",
                           config=ExportConfig(progress=False))
    return result, CalibrationAdapter.from_pretrained(root / "adapter"), tiny_llama_tied


@pytest.fixture(scope="module")
def untied_engine(tmp_path_factory, tiny_llama_untied, tiny_lora_untied):
    """Untied head + LoRA, in-memory adapter, TorchScript exporter, external weights."""
    root = tmp_path_factory.mktemp("untied")
    adapter = random_calibration_adapter(tiny_llama_untied, lora_dir=tiny_lora_untied, seed=7,
                                         temperature=0.7)
    result = export_engine(tiny_llama_untied, root / "engine", adapter=adapter,
                           config=ExportConfig(progress=False, exporter="torchscript",
                                               external_data=True))
    return result, adapter, tiny_llama_untied


@pytest.fixture(scope="module")
def tied_scale_engine(tmp_path_factory, tiny_llama_tied):
    """Tied head kept, calibration as elementwise ops after the head (no LoRA)."""
    root = tmp_path_factory.mktemp("tied-scale")
    adapter = random_calibration_adapter(tiny_llama_tied, seed=9)
    result = export_engine(tiny_llama_tied, root / "engine", adapter=adapter,
                           config=ExportConfig(progress=False, exporter="torchscript",
                                               head_layout="tied-scale"))
    return result, adapter, tiny_llama_tied


ENGINES = ["tied_lora_engine", "untied_engine", "tied_scale_engine"]


# ---------------------------------------------------------------------- independent parity
def _left_pad(sequences, pad):
    length = max(len(s) for s in sequences)
    ids = np.full((len(sequences), length), pad, np.int64)
    mask = np.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, length - len(seq):] = seq
        mask[row, length - len(seq):] = 1
    return ids, mask


def _reference(model_dir, adapter, ids, mask):
    """Greedy generation with the unfused model's KV cache; calibrated logits per step."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    if adapter.lora_path is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter.lora_path)).eval()
    tau, shift = torch.from_numpy(adapter.tau), torch.from_numpy(adapter.shift)
    mask_t = torch.from_numpy(mask)
    positions = (mask_t.cumsum(-1) - 1).clamp(min=0)
    cache, step_ids, prefill = DynamicCache(), torch.from_numpy(ids), None
    logits_per_step, tokens = [], []
    with torch.no_grad():
        for _ in range(STEPS):
            out = model(input_ids=step_ids, attention_mask=mask_t, position_ids=positions,
                        cache=cache, use_cache=True)
            logits = apply_calibration(out.logits, tau, shift, adapter.temperature)
            prefill = logits if prefill is None else prefill
            logits_per_step.append(logits[:, -1])
            tokens.append(logits[:, -1].argmax(-1))
            step_ids = tokens[-1][:, None]
            mask_t = torch.cat([mask_t, torch.ones_like(mask_t[:, :1])], 1)
            positions = positions[:, -1:] + 1
    return prefill.numpy(), torch.stack(logits_per_step, 1).numpy(), \
        torch.stack(tokens, 1).numpy()


def _engine_replay(engine_dir, manifest, ids, mask, tokens):
    """The engine run as calm serves it (ONNX Runtime through calm's backend; a packed
    builder graph through its in-place cache), fed the reference's tokens."""
    from calm_runtime.inference.backends import OnnxRuntimeBackend, PackedOnnxRuntimeBackend

    backend = OnnxRuntimeBackend(EngineManifest.load(engine_dir), threads=1)
    # the manifest decides the class: a packed graph gets the packed backend
    assert isinstance(backend, PackedOnnxRuntimeBackend) is manifest.packed
    assert backend.positions is not manifest.packed
    positions = np.clip(mask.cumsum(-1) - 1, 0, None)
    step_ids, prefill, per_step, state = ids, None, [], None
    for step in range(STEPS):
        logits, state = backend.run(step_ids, mask, positions, state)
        prefill = logits if prefill is None else prefill
        per_step.append(logits[:, -1])
        step_ids = tokens[:, step:step + 1]
        mask = np.concatenate([mask, np.ones_like(mask[:, :1])], 1)
        positions = positions[:, -1:] + 1
    return prefill, np.stack(per_step, 1)


@pytest.mark.parametrize("engine_fixture", ENGINES)
@pytest.mark.parametrize("batch", [1, 2])
def test_onnx_runtime_matches_the_reference(request, engine_fixture, batch):
    result, adapter, model_dir = request.getfixturevalue(engine_fixture)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = PROMPTS[:1] if batch == 1 else PROMPTS[1:]
    ids, mask = _left_pad([tokenizer(p)["input_ids"] for p in prompts],
                          result.manifest.model["pad_token_id"])
    ref_prefill, ref_steps, ref_tokens = _reference(model_dir, adapter, ids, mask)
    prefill, steps = _engine_replay(result.path, result.manifest, ids, mask, ref_tokens)
    real = mask.astype(bool)
    diff = max(float(np.abs(prefill - ref_prefill)[real].max()),
               float(np.abs(steps - ref_steps).max()))
    assert diff < ENGINE_ATOL, f"engine logits differ from the reference by {diff:.3g}"
    assert np.array_equal(steps.argmax(-1), ref_tokens), "greedy tokens differ"
    if batch == 2:
        assert not real.all(), "the batch-2 case must exercise left padding"


# ---------------------------------------------------------------------- the directory
def test_manifest_records_sources_calibration_and_validation(tied_lora_engine):
    result, adapter, model_dir = tied_lora_engine
    manifest = EngineManifest.load(result.path)  # hashes verified
    identity = model_identity(model_dir)
    assert manifest.source["model"] == {
        "name": identity.name, "vocab_size": 300, "tokenizer_sha256": identity.tokenizer_sha256,
        "weights_sha256": sha256_file(model_dir / "model.safetensors")}
    adapter_dir = adapter.lora_path.parent
    assert manifest.source["adapter"] == {
        "kind": "test", "path_name": "adapter",
        "tensors_sha256": sha256_file(adapter_dir / "calibration.safetensors"),
        "manifest_sha256": sha256_file(adapter_dir / "calm_adapter.json")}
    calibration = manifest.calibration
    assert calibration["fused"] is True
    assert calibration["temperature"] == pytest.approx(adapter.temperature)
    assert calibration["answer_temperature"] == pytest.approx(0.9)
    assert calibration["tau_min"] == pytest.approx(float(adapter.tau.min()))
    assert manifest.tokenizer["files"]["tokenizer.json"] == identity.tokenizer_sha256
    tokenizer = AutoTokenizer.from_pretrained(str(result.path))
    for text, token in manifest.option_tokens["plain"].items():
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == [token]
    assert set(manifest.option_tokens["plain"]) == {f" {c}" for c in "ABCDEFGHIJ"}
    assert manifest.p_true().true_token == " A"
    assert manifest.p_true_template["name"] == "kadavath"
    assert manifest.model["add_bos"] is True and manifest.model["bos_token_id"] == 1
    assert manifest.model["eos_token_ids"] == [2] and manifest.model["pad_token_id"] == 3
    report = manifest.validation
    assert report["passed"] and report["greedy_match"] and report["greedy_steps"] == STEPS
    assert report["max_abs_diff"] <= report["tolerance"]
    assert report["batch2_max_abs_diff"] <= report["tolerance"]
    # the default graph for Llama: onnxruntime-genai's builder graph, calibrated in its head
    assert manifest.export["exporter_used"].startswith("onnxruntime-genai ")
    assert manifest.export["graph"]["kind"] == "genai-builder" and manifest.packed
    assert manifest.export["graph"]["calibration_after_head"] == ["shift"]
    assert "position_ids" not in manifest.io["inputs"]
    assert manifest.export["source_head_tied"] is True
    assert sorted(p.name for p in result.path.iterdir()) == sorted(
        ["calm_engine.json", "genai_config.json", "model.onnx", "model.onnx.data",
         "tokenizer.json", "tokenizer_config.json"])
    assert not list(result.path.parent.glob(".engine.*")), "temporary folders were left behind"


def test_external_data_engine_lists_and_hashes_the_weights(untied_engine):
    result, _, _ = untied_engine
    files = result.manifest.model["files"]
    assert set(files) == {"model.onnx", "model.onnx.data"}
    assert result.file_sizes["model.onnx.data"] > 3 * result.file_sizes["model.onnx"]
    assert result.manifest.export["exporter_used"] == "torchscript"
    assert result.manifest.source["adapter"]["path_name"] is None  # in-memory adapter


def test_head_layouts_in_the_graph(tied_lora_engine, tied_scale_engine):
    import onnx

    def vocab_initializers(path):
        model = onnx.load(str(path / "model.onnx"))
        return [tuple(i.dims) for i in model.graph.initializer if 300 in tuple(i.dims)]

    # untied: the embedding and the fused head are two matrices, plus the fused bias [300]
    untied = vocab_initializers(tied_lora_engine[0].path)
    assert len([d for d in untied if len(d) == 2]) == 2 and untied.count((300,)) == 1
    # tied-scale: the head's MatMul is followed by the scale and shift vectors [300]
    assert vocab_initializers(tied_scale_engine[0].path).count((300,)) == 2


# ---------------------------------------------------------------------- onnxruntime-genai
def test_onnxruntime_genai_runs_the_engine(tied_lora_engine):
    result, adapter, model_dir = tied_lora_engine
    config = json.loads((result.path / "genai_config.json").read_text())
    assert config["model"]["decoder"]["num_hidden_layers"] == result.manifest.num_layers
    tokenizer = AutoTokenizer.from_pretrained(str(result.path))
    prompt = tokenizer(PROMPTS[0])["input_ids"]
    generated = genai_greedy(result.path, prompt, 10)
    ids, mask = _left_pad([prompt], 3)
    _, _, ref_tokens = _reference(model_dir, adapter, ids, mask)
    expected = []
    for token in ref_tokens[0]:  # genai stops at EOS; compare up to it
        expected.append(int(token))
        if token == 2:
            break
    assert generated == expected[:len(generated)] and len(generated) >= min(10, len(expected))


def test_the_fused_graph_fuses_rmsnorm_and_the_standard_one_has_standard_ops_only(
        tmp_path, tiny_llama_untied):
    """calm's own fused graph holds ONNX Runtime's fused RMSNorm (recorded in the manifest,
    validated like any graph); --graph standard, which a TensorRT build uses, holds only
    standard ONNX ops (the default domain), which TensorRT's parser reads."""
    import onnx

    from calm_export import ExportConfig, export_engine

    fast = {"progress": False, "exporter": "torchscript", "greedy_steps": 2}
    fused = export_engine(tiny_llama_untied, tmp_path / "fused",
                          config=ExportConfig(**fast, graph="fused"))
    standard = export_engine(tiny_llama_untied, tmp_path / "standard",
                             config=ExportConfig(**fast, graph="standard"))
    graph = fused.manifest.export["graph"]
    assert graph["kind"] == "ort-fused" and graph["fused_ops"]["SkipSimplifiedLayerNormalization"]
    domains = {n.domain for n in onnx.load(str(fused.path / "model.onnx")).graph.node}
    assert "com.microsoft" in domains
    assert standard.manifest.export["graph"]["kind"] == "standard"
    domains = {n.domain for n in onnx.load(str(standard.path / "model.onnx")).graph.node}
    assert domains <= {"", "ai.onnx"}
    assert fused.manifest.validation["max_abs_diff"] <= fused.manifest.validation["tolerance"]
