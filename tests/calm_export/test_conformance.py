"""The architecture conformance matrix: every family of tests/families.py, end to end.

For each family a random 2-layer model is built from its transformers config class (no
downloads) and given a random adapter: per-vocabulary tau, a shift, a temperature and a
LoRA on the family's attention projections. Then:

* ``calm-export`` (default settings) passes its own validation (prefill, 20 greedy KV-cache
  steps, a left-padded batch of 2), and the engine's prefill of a prompt longer than the
  sliding windows equals the torch reference computed here;
* the runtime's ``generate`` and ``choose`` equal the torch reference (tokens, confidences,
  option probabilities), and onnxruntime-genai generates the same tokens;
* ``calm fit daca`` and ``calm train`` (2 steps, default LoRA targets) run on the family,
  and training's answer head computes the family's own logits;
* ``--format hf`` folds tau and T into a checkpoint that transformers reloads with the same
  logits; the shift gets the one-line error where the family's head has no bias.

The reference is the unfused model with its LoRA merged and the calibration applied to its
logits by the formula module; the families' own post-head ops (soft-capping, logit
scaling) stay inside the model, so the reference is what the family computes.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from conftest import (  # noqa: E402
    FAMILIES,  # noqa: E402
    genai_greedy,
    random_calibration_adapter,
    tiny_tokenizer,
    write_mc_jsonl,
)

from calm_export import ExportConfig, export_engine  # noqa: E402
from calm_runtime import CalibratedLM  # noqa: E402
from calm_runtime.cli.main import main as calm_main  # noqa: E402
from calm_runtime.data.sets import MultipleChoiceRecord  # noqa: E402
from calm_runtime.errors import IncompatibleModelError  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter  # noqa: E402
from calm_runtime.inference.post_head import post_head  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_single_thread")

#: |engine - reference| on calibrated logits of 2 tiny layers (measured ~3e-6)
LOGIT_ATOL = 1e-4
#: a prompt of ~60 byte-level tokens: longer than every family's sliding window (8)
LONG_PROMPT = ("Question: Which of these animals lives in the sea, far from any river?\n"
               "Answer:")
QUESTIONS = [("Where do penguins mostly live?", ["the Arctic", "Antarctica", "the Sahara"]),
             ("Which number is prime?", ["4", "7"])]


def _build_model(family, folder):
    torch.manual_seed(0)
    config = getattr(transformers, family.config_class)(**family.tiny_config())
    model = getattr(transformers, family.model_class)(config).eval()
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)


def _build_lora(family, model_dir, folder):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                 target_modules=list(family.lora_targets)))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    peft_model.save_pretrained(folder)


@dataclasses.dataclass
class Case:
    family: object
    model_dir: object
    adapter: CalibrationAdapter
    adapter_dir: object
    engine: object
    reference: object  # the model with its LoRA merged (torch, eval)
    tokenizer: object
    root: object


@pytest.fixture(scope="module", params=FAMILIES, ids=[f.name for f in FAMILIES])
def case(request, tmp_path_factory):
    from calm_runtime.data.models import load_model_and_tokenizer

    family = request.param
    root = tmp_path_factory.mktemp(family.model_type)
    model_dir, lora_dir = root / "model", root / "lora"
    _build_model(family, model_dir)
    _build_lora(family, model_dir, lora_dir)
    adapter = random_calibration_adapter(model_dir, lora_dir=lora_dir, seed=5)
    adapter.save_pretrained(root / "adapter")
    adapter = CalibrationAdapter.from_pretrained(root / "adapter")
    result = export_engine(model_dir, root / "engine", adapter=root / "adapter",
                           config=ExportConfig(progress=False))
    reference, tokenizer, _ = load_model_and_tokenizer(model_dir, lora_path=adapter.lora_path)
    return Case(family, model_dir, adapter, root / "adapter", result.path, reference.eval(),
                tokenizer, root)


def _reference_logits(case, ids):
    with torch.inference_mode():
        logits = case.reference(input_ids=torch.tensor([ids])).logits[0].float()
    return case.adapter.calibrate(logits).double().numpy()


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _reference_greedy(case, ids, steps, *, valid=None):
    """Greedy over the head, or (``valid``: calm's runtime, the tokenizer's size) over the
    ids the tokenizer can render; the probabilities are the whole head's either way."""
    ids, out = list(ids), []
    for _ in range(steps):
        p = _softmax(_reference_logits(case, ids)[-1])
        token = int(np.argmax(p[:valid]))
        out.append((token, float(p[token])))
        ids.append(token)
    return out


def test_export_passes_validation_and_records_the_post_head_op(case):
    manifest = json.loads((case.engine / "calm_engine.json").read_text())
    report = manifest["validation"]
    assert report["passed"] and report["greedy_match"] and report["greedy_steps"] == 20
    assert report["max_abs_diff"] <= report["tolerance"] and "batch2" in report["cases"]
    expected = post_head(case.reference)
    assert manifest["export"]["post_head"]["kind"] == expected.kind
    assert expected.kind == {"Gemma-2": "softcap", "Granite": "scale",
                             "Cohere": "scale"}.get(case.family.name, "none")


@pytest.mark.parametrize("graph", ["fused", "standard"])
def test_calms_own_graph_exports_every_family(case, graph):
    """calm's own graph (what the README's main command exports when onnxruntime-genai is not
    installed) for every family, with the head found in the graph by its structure: it
    passes the export's validation and equals the reference past the sliding window, and
    its prefill keeps only the positions asked for (the head's Slice is in place)."""
    out = case.root / f"own-{graph}"
    result = export_engine(case.model_dir, out, adapter=case.adapter_dir,
                           config=ExportConfig(graph=graph, progress=False))
    manifest = json.loads((result.path / "calm_engine.json").read_text())
    assert manifest["validation"]["passed"], manifest["validation"]
    kind = manifest["export"]["graph"]["kind"]
    assert kind == "standard" if graph == "standard" else kind in ("ort-fused", "standard")
    ids = case.tokenizer(LONG_PROMPT)["input_ids"]
    session = ort.InferenceSession(str(result.path / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    empty = np.zeros((1, manifest["model"]["num_kv_heads"], 0,
                      manifest["model"]["head_dim"]), np.float32)
    feed = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
            "position_ids": np.arange(len(ids))[None], "logits_to_keep": np.array([1])}
    feed.update({i.name: empty for i in session.get_inputs()
                 if i.name.startswith("past_key_values")})
    logits = session.run(["logits"], feed)[0][0]
    assert logits.shape[0] == 1  # only the last position was projected
    np.testing.assert_allclose(logits[-1], _reference_logits(case, ids)[-1], atol=LOGIT_ATOL,
                               rtol=0)


def test_engine_prefill_equals_the_reference_past_the_window(case):
    from calm_runtime.formats.engine import engine_io_names

    ids = case.tokenizer(LONG_PROMPT)["input_ids"]
    assert len(ids) > 2 * 8
    engine = json.loads((case.engine / "calm_engine.json").read_text())
    manifest = engine["model"]
    session = ort.InferenceSession(str(case.engine / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    positions = "position_ids" in engine["io"]["inputs"]
    inputs, _ = engine_io_names(manifest["num_layers"], position_ids=positions)
    assert sorted(i.name for i in session.get_inputs()) == sorted(inputs)
    empty = np.zeros((1, manifest["num_kv_heads"], 0, manifest["head_dim"]), np.float32)
    feed = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64)}
    if positions:
        feed["position_ids"] = np.arange(len(ids))[None]
    feed.update({name: empty for name in inputs if name.startswith("past_key_values")})
    logits = session.run(["logits"], feed)[0][0]
    np.testing.assert_allclose(logits, _reference_logits(case, ids), atol=LOGIT_ATOL, rtol=0)


def test_default_graph_is_the_builders_where_it_builds_the_family(case):
    from calm_export.graphs.builder import BUILDER_FAMILIES

    graph = json.loads((case.engine / "calm_engine.json").read_text())["export"]["graph"]
    mistral_window = case.family.model_type == "mistral"  # its builder graph ignores the window
    if case.family.model_type in BUILDER_FAMILIES and not mistral_window:
        assert graph["kind"] == "genai-builder", graph
    else:
        assert graph["kind"] in ("ort-fused", "standard") and graph["builder_not_used"], graph


def test_a_left_padded_batch_equals_its_rows_alone(case):
    """Two prompts of different lengths in one left-padded batch: prefill logits at the real
    positions and 6 greedy decode steps equal each prompt run alone (batch 1)."""
    from calm_runtime.inference.generation import initial_positions, left_pad

    backend = CalibratedLM.load(case.engine, threads=1).backend
    rows = [case.tokenizer(LONG_PROMPT)["input_ids"], case.tokenizer("Answer:")["input_ids"]]

    def roll(sequences):
        ids, mask = left_pad(sequences, 3)
        positions = initial_positions(mask)
        logits, state = backend.run(ids, mask, positions, None)
        prefill = [logits[b, ids.shape[1] - len(s):] for b, s in enumerate(sequences)]
        steps = []
        positions = positions[:, -1:]
        for _ in range(6):
            token = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
            mask = np.concatenate([mask, np.ones_like(token)], axis=1)
            positions = positions + 1
            logits, state = backend.run(token, mask, positions, state)
            steps.append(logits[:, -1])
        return prefill, np.stack(steps, 1)

    batch_prefill, batch_steps = roll(rows)
    assert len(rows[0]) > len(rows[1]) + 8  # real left padding
    for b, row in enumerate(rows):
        alone_prefill, alone_steps = roll([row])
        np.testing.assert_allclose(batch_prefill[b], alone_prefill[0], atol=LOGIT_ATOL, rtol=0)
        np.testing.assert_allclose(batch_steps[b], alone_steps[0], atol=LOGIT_ATOL, rtol=0)


def test_runtime_generate_equals_the_reference(case):
    lm = CalibratedLM.load(case.engine, threads=1)
    ids = case.tokenizer(LONG_PROMPT)["input_ids"]
    generation = lm.generate(LONG_PROMPT, max_new_tokens=12)
    want = _reference_greedy(case, ids, len(generation.tokens), valid=len(case.tokenizer))
    assert [t.id for t in generation.tokens] == [w[0] for w in want]
    np.testing.assert_allclose([t.confidence for t in generation.tokens],
                               [w[1] for w in want], atol=1e-4)
    assert len(generation.tokens) == 12 or generation.tokens[-1].id == 2


def test_runtime_choose_equals_the_reference(case):
    from calm_training.scoring.local import score_multiple_choice

    lm = CalibratedLM.load(case.engine, threads=1)
    records = [MultipleChoiceRecord(question=q, choices=tuple(o)) for q, o in QUESTIONS]
    scores = score_multiple_choice(case.reference, case.tokenizer, records, mode="cloze",
                                   calibration=case.adapter, progress=False)
    for variant in ("sum", "mean"):
        want = scores.scores(variant)
        choices = lm.choose_batch([q for q, _ in QUESTIONS], [o for _, o in QUESTIONS],
                                  variant=variant)
        for row, choice in enumerate(choices):
            k = len(QUESTIONS[row][1])
            np.testing.assert_allclose(choice.scores, want[row, :k], atol=1e-3)
            expected = _softmax(want[row, :k] / case.adapter.answer_temperature)
            np.testing.assert_allclose(choice.probabilities, expected, atol=2e-4)


def test_onnxruntime_genai_generates_the_reference_tokens(case):
    if not case.family.genai:
        pytest.skip(f"onnxruntime-genai does not run {case.family.name} engines")
    ids = case.tokenizer(LONG_PROMPT)["input_ids"]
    generated = genai_greedy(case.engine, ids, 10)
    expected = []
    for token, _ in _reference_greedy(case, ids, 10):
        expected.append(token)
        if token == 2:  # genai stops at EOS
            break
    assert generated == expected


def test_fit_daca_and_train_run_on_the_family(case, capsys):
    data = write_mc_jsonl(case.root / "mc.jsonl", n=24)
    out = case.root / "daca"
    rc = calm_main(["-q", "fit", "daca", "--model", str(case.model_dir), "--reference",
                    str(case.model_dir), "--data", str(data), "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert CalibrationAdapter.from_pretrained(out).kind == "daca"
    out = case.root / "calm"
    rc = calm_main(["-q", "train", "--model", str(case.model_dir), "--train", f"{data}:train",
                    "--calibration", f"{data}:unlabeled", "--out", str(out), "--steps", "2",
                    "--batch-size", "2", "--lora-rank", "2", "--set", "warm_start_steps=1",
                    "--holdout", "0"])  # α as trained (the gate: test_alpha_gate.py)
    assert rc == 0, capsys.readouterr().err
    trained = CalibrationAdapter.from_pretrained(out)
    targets = json.loads((trained.lora_path / "adapter_config.json").read_text())
    assert set(case.family.lora_targets) <= set(targets["target_modules"])
    assert np.ptp(trained.shift) > 0  # tau/shift were trained on this family's logits


def _tau_only(case):
    return dataclasses.replace(case.adapter, shift=np.zeros_like(case.adapter.shift))


def test_hf_checkpoint_reloads_with_the_calibrated_logits(case):
    """tau and T fold exactly wherever the head is linear; a soft-capped family folds one
    temperature only, and the shift needs a head bias (none of these families has one)."""
    kind = post_head(case.reference).kind
    adapter = _tau_only(case)
    if kind == "softcap":
        with pytest.raises(IncompatibleModelError, match="soft-caps its logits"):
            export_engine(case.model_dir, case.root / "hf-tau", adapter=adapter,
                          config=ExportConfig(progress=False, format="hf"))
        assert not (case.root / "hf-tau").exists()
        adapter = dataclasses.replace(adapter, tau=np.full_like(adapter.tau, 1.7))
    result = export_engine(case.model_dir, case.root / "hf", adapter=adapter,
                           config=ExportConfig(progress=False, format="hf"))
    manifest = json.loads((result.path / "calm_checkpoint.json").read_text())
    assert manifest["schema_version"] == 1 and manifest["calibration"]["folded"]["shift"] == "none"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(result.path)).eval()
    ids = case.tokenizer(LONG_PROMPT)["input_ids"]
    with torch.inference_mode():
        got = reloaded(input_ids=torch.tensor([ids])).logits[0].double().numpy()
        raw = case.reference(input_ids=torch.tensor([ids])).logits[0].float()
    np.testing.assert_allclose(got, adapter.calibrate(raw).double().numpy(), atol=LOGIT_ATOL,
                               rtol=0)
    with pytest.raises(IncompatibleModelError, match="shift|soft-caps"):
        export_engine(case.model_dir, case.root / "hf-shift", adapter=case.adapter,
                      config=ExportConfig(progress=False, format="hf"))
    assert not (case.root / "hf-shift").exists()


def test_training_computes_the_family_logits(case):
    """calm train's answer head (decoder, head, then the family's post-head op) gives the
    model's own logits: soft cap and logit scaling included."""
    from calm_training.methods.calm.model import AnswerHead

    ids = torch.tensor([case.tokenizer(LONG_PROMPT)["input_ids"]])
    positions = torch.tensor([3, 10, ids.shape[1] - 1])
    with torch.inference_mode():
        want = case.reference(input_ids=ids).logits[0, positions].float()
        got = AnswerHead(case.reference)(ids, torch.ones_like(ids), positions)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
