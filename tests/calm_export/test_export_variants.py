"""Engine variants on tiny Llamas: int8 (blockwise, dynamic), fp16, ECE and --recalibrate.

The calibration data is made from the fp32 runtime engine's own answers (a quarter of the
labels moved to another option), so the tiny random model is 75% accurate with flat,
underconfident probabilities: a temperature fit has a clear optimum below 1.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from calm_export import ExportConfig, export_engine, quantize, recalibrate  # noqa: E402
from calm_export.validate import Case, Rollout  # noqa: E402
from calm_runtime.data.sets import MultipleChoiceRecord, write_jsonl  # noqa: E402
from calm_runtime.errors import ConfigError, ExportValidationError  # noqa: E402
from calm_runtime.inference.lm import CalibratedLM  # noqa: E402
from calm_runtime.measure import metrics  # noqa: E402

FAST = {"progress": False, "exporter": "torchscript", "greedy_steps": 4}
TOPICS = ["cats", "rivers", "stars", "bread", "trains", "salt", "moss", "glass"]

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(scope="module")
def mc_data(runtime_engine, tmp_path_factory):
    """``{"letter": path, "cloze": path}``: 24 questions labeled by the fp32 engine's answers."""
    _, _, engine_dir = runtime_engine
    questions = [f"Which one is {i} {t}?" for i, t in enumerate(TOPICS * 3)]
    options = [[f"{c} {i}" for c in ("red", "blue", "green", "gray")] for i in range(24)]
    lm = CalibratedLM.load(engine_dir)
    folder, paths = tmp_path_factory.mktemp("mc-data"), {}
    for mode, variant in (("letter", None), ("cloze", "mean")):
        picked = [c.prediction for c in lm.choose_batch(questions, options, mode,
                                                        variant=variant)]
        labels = [p if i % 4 else (p + 1) % 4 for i, p in enumerate(picked)]
        paths[mode] = write_jsonl(folder / f"{mode}.jsonl", [
            MultipleChoiceRecord(question=q, choices=tuple(o), answer=y)
            for q, o, y in zip(questions, options, labels, strict=True)])
    lm.close()
    return paths


@pytest.fixture(scope="module")
def int8_letter(runtime_engine, mc_data, tmp_path_factory):
    """Default int8 (blockwise, every MatMul) + LoRA adapter + letter-mode recalibration."""
    model_dir, adapter_dir, _ = runtime_engine
    out = tmp_path_factory.mktemp("int8-letter") / "engine"
    config = ExportConfig(**FAST, quantize="int8", calibration_data=str(mc_data["letter"]),
                          recalibrate=True, calibration_mode="letter")
    return export_engine(model_dir, out, adapter=adapter_dir, config=config)


@pytest.fixture(scope="module")
def fp16_cloze(runtime_engine, mc_data, tmp_path_factory):
    """fp16 ONNX + cloze-mode recalibration of answer_temperature."""
    model_dir, adapter_dir, _ = runtime_engine
    out = tmp_path_factory.mktemp("fp16-cloze") / "engine"
    config = ExportConfig(**FAST, dtype="fp16", recalibrate=True, calibration_mode="cloze",
                          calibration_data=str(mc_data["cloze"]))
    return export_engine(model_dir, out, adapter=adapter_dir, config=config)


def _sane_drift(drift):
    assert drift["positions"] > 100
    assert 0.9 <= drift["greedy_agreement"] <= 1.0
    assert 0.0 <= drift["mean_total_variation"] <= drift["max_total_variation"] <= 1.0
    assert 0.0 <= drift["mean_prob_change"] <= drift["max_prob_change"] <= 1.0
    assert drift["max_abs_logit_diff"] > 0.0  # the variant is not the fp32 graph


# ---------------------------------------------------------------------- int8
def test_int8_engine_records_scheme_sizes_and_drift(int8_letter):
    manifest = int8_letter.manifest
    facts = manifest.export["int8"]
    assert manifest.export["quantize"] == "int8" and manifest.model["dtype"] == "float32"
    assert facts["scheme"] == "blockwise" and facts["block_size"] == 32 and facts["bits"] == 8
    assert facts["exclude"] == [] and facts["excluded_nodes"] == []
    assert facts["quantized_nodes"] == facts["linear_nodes"] == 2 * 7 + 1  # + the head
    assert facts["bytes"] == int8_letter.file_sizes["model.onnx"] < facts["fp32_bytes"]
    _sane_drift(facts["drift"])
    assert not [p for p in int8_letter.path.iterdir() if p.name.startswith(".")]
    assert manifest.validation["int8_min_agreement"] == 0.9


def test_int8_graph_has_no_fp32_weight_matmul_left(int8_letter):
    graph = onnx.load(str(int8_letter.path / "model.onnx")).graph
    assert sum(n.op_type == "MatMulNBits" for n in graph.node) == 15
    assert quantize.linear_nodes(onnx.load(str(int8_letter.path / "model.onnx"))) == []


def test_letter_recalibration_folds_the_temperature_into_the_head(int8_letter, mc_data):
    manifest = int8_letter.manifest
    check = manifest.export["calibration_check"]
    assert check["mode"] == "letter" and check["n"] == 24 and check["in_sample"] is True
    assert set(check) >= {"fp32", "int8", "recalibrated", "recalibration"}
    fitted = check["recalibration"]["fit"]["temperature"]
    assert fitted < 1.0  # the tiny model is underconfident on this data
    assert check["recalibrated"]["nll"] <= check["int8"]["nll"] + 1e-9
    assert check["recalibrated"]["ece"] <= check["int8"]["ece"]
    assert manifest.calibration["temperature"] == pytest.approx(1.2 * fitted)
    assert check["recalibration"]["parameter"] == "temperature"
    assert check["recalibration"]["before"] == pytest.approx(1.2)
    assert len(check["recalibration"]["folded_into"]) == 2  # the bias and the block scales
    assert check["fold_max_abs_diff"] < 1e-4
    # the written engine, loaded as a user would, gives the recalibrated numbers
    data = recalibrate.load_calibration_data(str(mc_data["letter"]))
    lm = CalibratedLM.load(int8_letter.path)
    probs = np.stack([c.probabilities for c in lm.choose_batch(data.questions, data.options,
                                                                "letter")])
    again = metrics.calibration_report(probs, data.labels)
    assert again["ece"] == pytest.approx(check["recalibrated"]["ece"], abs=1e-6)
    assert lm.generate("Hi", max_new_tokens=3).tokens


def test_dynamic_int8_keeps_the_excluded_modules_in_fp32(tmp_path, tiny_llama_untied):
    config = ExportConfig(**FAST, quantize="int8", int8_scheme="dynamic",
                          int8_exclude=("lm_head", "mlp.down_proj"), int8_min_agreement=0.0)
    result = export_engine(tiny_llama_untied, tmp_path / "engine", config=config)
    facts = result.manifest.export["int8"]
    kept = {e["module"]: e["node"] for e in facts["excluded_nodes"]}
    assert set(kept) == {"lm_head", "model.layers.0.mlp.down_proj",
                         "model.layers.1.mlp.down_proj"}
    graph = onnx.load(str(result.path / "model.onnx")).graph
    ops = {n.name: n.op_type for n in graph.node}
    assert all(ops[name] == "MatMul" for name in kept.values())
    assert sum(op == "MatMulInteger" for op in ops.values()) == facts["quantized_nodes"] == 12
    assert 0.0 <= facts["drift"]["greedy_agreement"] <= 1.0
    lm = CalibratedLM.load(result.path)
    assert len(lm.generate("Hi", max_new_tokens=3).tokens) == 3


def test_low_int8_agreement_fails_and_writes_nothing(tmp_path, tiny_llama_untied, monkeypatch):
    real = quantize.measure_drift
    monkeypatch.setattr(quantize, "measure_drift",
                        lambda *a: {**real(*a), "greedy_agreement": 0.5})
    with pytest.raises(ExportValidationError, match=r"50\.0% of .*--int8-exclude"):
        export_engine(tiny_llama_untied, tmp_path / "engine",
                      config=ExportConfig(**FAST, quantize="int8"))
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- fp16
def test_fp16_engine_is_validated_with_the_fp16_tolerance(fp16_cloze):
    manifest = fp16_cloze.manifest
    assert manifest.model["dtype"] == "float16"
    report = manifest.validation["fp16"]
    assert report["max_abs_diff"] <= report["tolerance"]
    assert report["tolerance"] > manifest.validation["tolerance"]  # fp16's, not fp32's
    assert manifest.validation["max_abs_diff"] <= manifest.validation["tolerance"]  # fp32 twin
    _sane_drift(manifest.export["fp16"]["drift"])
    session = ort.InferenceSession(str(fp16_cloze.path / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    types = {i.name: i.type for i in session.get_inputs()}
    assert types["past_key_values.0.key"] == "tensor(float16)"
    assert session.get_outputs()[0].type == "tensor(float)"


def test_cloze_recalibration_refits_answer_temperature(fp16_cloze, mc_data):
    manifest = fp16_cloze.manifest
    check = manifest.export["calibration_check"]
    assert check["mode"] == "cloze" and check["variant"] == "mean"
    assert manifest.export["cloze_variant"] == "mean"
    fit = check["recalibration"]["fit"]
    assert manifest.calibration["answer_temperature"] == pytest.approx(fit["temperature"])
    assert check["recalibration"]["before"] == pytest.approx(0.9)
    assert check["recalibrated"]["nll"] <= check["fp16"]["nll"] + 1e-9
    assert check["recalibrated"]["ece"] <= check["fp16"]["ece"]
    assert check["fp32"]["accuracy"] == pytest.approx(check["fp16"]["accuracy"], abs=0.1)
    data = recalibrate.load_calibration_data(str(mc_data["cloze"]))
    lm = CalibratedLM.load(fp16_cloze.path)
    probs = np.stack([c.probabilities for c in lm.choose_batch(data.questions, data.options)])
    again = metrics.calibration_report(probs, data.labels)
    assert again["ece"] == pytest.approx(check["recalibrated"]["ece"], abs=1e-6)


# ---------------------------------------------------------------------- pieces
def test_config_refuses_inconsistent_variant_settings():
    with pytest.raises(ConfigError) as info:
        ExportConfig(quantize="int8", format="tensorrt", int8_block_size=24,
                     int8_exclude="lm_head", recalibrate=True, calibration_mode="words",
                     int8_min_agreement=2)
    message = str(info.value)
    for part in ("--format onnx", "int8_block_size", "int8_exclude", "recalibrate needs",
                 "calibration_mode", "int8_min_agreement"):
        assert part in message
    with pytest.raises(ConfigError, match="--dtype fp32"):
        ExportConfig(quantize="int8", dtype="fp16")
    assert ExportConfig(int8_scheme="dynamic").int8_excluded_modules()[:2] == (
        "lm_head", "mlp.down_proj")


def test_module_path_reads_both_exporters_names():
    dynamo = helper.make_node("MatMul", ["a", "b"], ["c"], name="node_linear_6")
    entry = dynamo.metadata_props.add()
    entry.key, entry.value = "pkg.torch.onnx.name_scopes", (
        "['', 'model', 'model.model', 'model.model.layers.0', 'model.model.layers.0.mlp', "
        "'model.model.layers.0.mlp.down_proj', 'linear_6']")
    assert quantize.module_path(dynamo) == "model.layers.0.mlp.down_proj"
    script = helper.make_node("MatMul", ["a", "b"], ["c"], name="/model/lm_head/MatMul")
    assert quantize.module_path(script) == "lm_head"
    assert quantize.module_path(helper.make_node("MatMul", ["a", "b"], ["c"], name="x")) == ""


def _head_graph(kind: str):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(4, 6)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.normal(size=6).astype(np.float32), "b")
    s = numpy_helper.from_array(rng.normal(size=6).astype(np.float32), "s")
    if kind == "matmul":
        nodes = [helper.make_node("MatMul", ["h", "w"], ["z"]),
                 helper.make_node("Add", ["z", "b"], ["logits"])]
        inits = [w, b]
    elif kind == "tied-scale":
        nodes = [helper.make_node("MatMul", ["h", "w"], ["z"]),
                 helper.make_node("Mul", ["z", "s"], ["y"]),
                 helper.make_node("Add", ["y", "b"], ["logits"]),
                 helper.make_node("Gather", ["w", "i"], ["unused"])]  # the tie
        inits = [w, b, s, numpy_helper.from_array(np.array([0], np.int64), "i")]
    else:  # a head whose scale is computed at run time, like a dynamically quantised one
        nodes = [helper.make_node("MatMul", ["h", "w"], ["z"]),
                 helper.make_node("Mul", ["z", "h2"], ["y"]),
                 helper.make_node("Add", ["y", "b"], ["logits"])]
        inits = [w, b]
    inputs = [helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, 4])]
    if kind == "runtime-scale":
        inputs.append(helper.make_tensor_value_info("h2", TensorProto.FLOAT, [2, 6]))
    graph = helper.make_graph(nodes, "head", inputs,
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("kind, expected", [("matmul", ["b", "w"]), ("tied-scale", ["b", "s"])])
def test_fold_temperature_scales_the_logits_exactly(tmp_path, kind, expected):
    path = tmp_path / "model.onnx"
    onnx.save(_head_graph(kind), str(path))
    h = {"h": np.random.default_rng(1).normal(size=(2, 4)).astype(np.float32)}

    def logits():
        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
            None, h)[0]

    before = logits()
    assert recalibrate.fold_temperature(path, 1 / 1.7, external=False) == expected
    np.testing.assert_allclose(logits(), before / 1.7, rtol=1e-6, atol=1e-6)


def test_a_head_without_constant_scale_cannot_be_folded():
    with pytest.raises(ConfigError, match=r"cannot fold .*\(a Mul node"):
        recalibrate.head_constants(_head_graph("runtime-scale"))


def test_measure_drift_on_known_distributions():
    mask = np.array([[0, 1, 1]])
    case = Case("c", np.zeros((1, 3), np.int64), mask)
    base_prefill = np.zeros((1, 3, 2), np.float32)
    base = Rollout(base_prefill, np.zeros((1, 2, 2), np.float32), np.zeros((1, 2), np.int64))
    shifted = np.zeros((1, 2, 2), np.float32)
    shifted[0, 1] = [0.0, np.log(3.0)]  # second step: p = (1/4, 3/4) instead of (1/2, 1/2)
    other = Rollout(base_prefill, shifted, np.zeros((1, 2), np.int64))
    drift = quantize.measure_drift([case], [base], [other])
    assert drift["positions"] == 3  # one real prompt position (the last is step 0) + 2 steps
    assert drift["max_prob_change"] == pytest.approx(0.25)
    assert drift["max_total_variation"] == pytest.approx(0.25)
    assert drift["mean_total_variation"] == pytest.approx(0.25 / 3)
    assert drift["greedy_agreement"] == pytest.approx(2 / 3)
    same = quantize.measure_drift([case], [base], [base])
    assert same["greedy_agreement"] == 1.0 and same["max_prob_change"] == 0.0
    low, high = drift["greedy_agreement_interval"]
    assert low < 2 / 3 < high


def test_the_agreement_interval_is_wilsons():
    """Values of the 95% Wilson score interval worked by hand: 406 of 415 positions gives
    0.9593-0.9885; all of 10 gives 0.7225-1; none of 0 says nothing."""
    np.testing.assert_allclose(quantize.wilson_interval(406, 415), [0.95930, 0.98855],
                               atol=5e-5)
    np.testing.assert_allclose(quantize.wilson_interval(10, 10), [0.72247, 1.0], atol=5e-5)
    assert quantize.wilson_interval(0, 0) == [0.0, 1.0]


def test_cli_summary_shows_variant_drift_and_ece(int8_letter, fp16_cloze):
    from calm_export.cli import summary

    text = summary(int8_letter)
    assert "int8 (blockwise 32, 15/15 MatMuls)" in text and "top-1 agreement" in text
    assert "ECE on " in text and "fp32 " in text and "-> recalibrated " in text
    assert "token-level temperature multiplied by" in text
    text = summary(fp16_cloze)
    assert "fp16 (float16 weights and KV cache)" in text and "answer_temperature" in text


# ---------------------------------------------------------------------- int4
@pytest.mark.parametrize("graph", ["own", "builder"])
def test_int4_engine_quantises_every_matmul_records_drift_and_recalibrates(
        runtime_engine, mc_data, tmp_path, graph):
    """--quantize int4: 4-bit MatMulNBits on every MatMul, the drift report, a cloze
    recalibration on the quantised engine's own scores, and the runtime loads it; from
    calm's own graph and from onnxruntime-genai's builder graph (the default)."""
    model_dir, adapter_dir, _ = runtime_engine
    settings = FAST if graph == "own" else {"progress": False, "greedy_steps": 4}
    config = ExportConfig(**settings, quantize="int4", calibration_data=str(mc_data["cloze"]),
                          recalibrate=True, calibration_mode="cloze", int4_min_agreement=0.5)
    result = export_engine(model_dir, tmp_path / "engine", adapter=adapter_dir, config=config)
    manifest = result.manifest
    assert manifest.packed is (graph == "builder")
    assert (manifest.export["graph"]["kind"] == "genai-builder") is (graph == "builder")
    facts = manifest.export["int4"]
    assert facts["bits"] == 4 and facts["op"] == "MatMulNBits"
    assert facts["block_size"] == ExportConfig().int4_block_size
    assert facts["quantized_nodes"] == facts["linear_nodes"] > 0
    graph = onnx.load(str(result.path / "model.onnx")).graph
    bits = {a.i for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute
            if a.name == "bits"}
    assert bits == {4}
    assert quantize.linear_nodes(onnx.load(str(result.path / "model.onnx"))) == []
    drift = facts["drift"]
    assert drift["positions"] > 100 and 0.5 <= drift["greedy_agreement"] <= 1.0
    assert manifest.validation["int4_min_agreement"] == 0.5
    check = manifest.export["calibration_check"]
    assert set(check) >= {"fp32", "int4", "recalibrated", "recalibration"}
    lm = CalibratedLM.load(result.path, threads=1)
    out = lm.generate("The cat", 3)
    prompt = lm.tokenizer.encode("The cat")
    lm.close()
    assert len(out.tokens) == 3
    if graph == "builder":  # onnxruntime-genai runs the int4 engine folder as it is
        from conftest import genai_greedy

        generated = genai_greedy(result.path, prompt, 3)
        assert generated == [t.id for t in out.tokens][:len(generated)] and generated
        # and calm serve serves it
        httpx = pytest.importorskip("httpx")
        pytest.importorskip("fastapi")
        from calm_runtime.server import ServeConfig, create_app
        from calm_runtime.server.background import serve_in_background

        config = ServeConfig(engine=str(result.path), model_name="int4", threads=1)
        with serve_in_background(create_app(config)) as (url, _):
            reply = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "int4", "prompt": "The cat", "max_tokens": 3, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == out.text
