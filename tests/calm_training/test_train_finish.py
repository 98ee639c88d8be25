"""``calm train`` ends calibrated (calm_training.methods.calm.finish): a DACA temperature of the
trained model against the model before the LoRA that keeps every answer, gated on the
hold-out like α, written into the same adapter with what each part did on the hold-out's
reporting half; ``calm-export`` fuses all of it in one step."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from calm_runtime.errors import FitError  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter  # noqa: E402
from calm_training.methods.calm import data as calm_data  # noqa: E402
from calm_training.methods.calm import finish as finish_module  # noqa: E402
from calm_training.methods.calm.config import CalmConfig  # noqa: E402
from calm_training.methods.calm.trainer import train_calm  # noqa: E402

pytestmark = pytest.mark.usefixtures("private_calm_cache")


def _config(model, data, **kw):
    return CalmConfig(**{"model": str(model), "train": (f"{data}:train",),
                         "calibration": (f"{data}:unlabeled",), "steps": 2,
                         "warm_start_steps": 1, "batch_size": 2, "lora_rank": 4,
                         "max_length": 64, "holdout": 0.3, **kw})


@pytest.fixture(scope="module")
def trained(tiny_llama_tied, mixed_mc_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("finish") / "calm"
    config = _config(tiny_llama_tied, mixed_mc_file)
    return config, train_calm(config, out, progress=False)


@pytest.fixture(scope="module")
def ungated(tiny_llama_tied, mixed_mc_file, tmp_path_factory):
    """``--holdout 0``: T written as fitted (no hold-out to gate it on)."""
    out = tmp_path_factory.mktemp("finish") / "ungated"
    config = _config(tiny_llama_tied, mixed_mc_file, holdout=0)
    return config, train_calm(config, out, progress=False)


def test_the_temperature_is_fitted_against_the_base_and_gated(trained):
    config, result = trained
    adapter = CalibrationAdapter.from_pretrained(result.out)
    record = adapter.method["daca"]
    assert record["fitted"], record
    assert record["reference"] == "the model before the LoRA"
    assert record["reference_identity"]["name"] == adapter.base_model.name
    fit = record["fit"]
    assert fit["method"] == "daca" and 0 < fit["agreement_rate"] <= 1
    n_cal = len(calm_data.load_records(config.calibration, labeled=False)[0])
    assert fit["n"] == record["n_questions"] <= n_cal  # the unlabeled calibration set
    gate = record["gate"]
    assert gate["part"] == "T" and gate["n"] == adapter.metrics["holdout_parts"]["deciding"]
    assert record["kept"] == gate["kept"]
    assert (adapter.kind == "calm+daca") == gate["kept"]
    assert (adapter.answer_temperature is not None) == gate["kept"]
    # a temperature on option scores changes no answer: its accuracy interval is [0, 0]
    assert gate["accuracy_change_interval"] == [0.0, 0.0]
    assert adapter.method["name"] == "calm" and "alpha_gate" in adapter.method
    assert result.daca == record


def test_cloze_keeps_the_answers_and_reports_the_token_temperature_apart(ungated):
    """Cloze: T is the answer temperature on the trained model's own scores, the head keeps
    temperature 1, and the token-level temperature is fitted and reported, with the answers
    a head temperature would have changed."""
    _, result = ungated
    adapter = CalibrationAdapter.from_pretrained(result.out)
    record = adapter.method["daca"]
    assert record["kept"] and "ungated" in record["gate"]["reason"]
    assert adapter.kind == "calm+daca"
    assert adapter.answer_temperature == pytest.approx(record["fit"]["temperature"])
    assert adapter.temperature == 1.0
    assert record["token_fit"]["fitted"] and record["token_fit"]["in_head"] is False
    assert record["token_temperature"] == record["token_fit"]["temperature"] != 1.0
    assert record["keeps_answers"] is True
    lines = finish_module.part_lines(record, None)
    assert any("not in the head" in line for line in lines)


@pytest.mark.parametrize(("mode", "variant"), [("cloze", "mean"), ("cloze", "sum"),
                                               ("cloze", "char"), ("letter", None)])
def test_the_written_adapter_changes_no_answer_of_the_trained_model(
        mode, variant, tiny_llama_tied, mixed_mc_file, tmp_path):
    """Every mode and cloze variant: the adapter as written (LoRA, α, T) predicts the same
    option as the trained model without T on every question, calibration and test parts."""
    kw = {"mode": mode, "holdout": 0}
    if variant:
        kw["cloze_variant"] = variant
    else:  # the letter prompt lists every option
        kw["max_length"] = 192
    config = _config(tiny_llama_tied, mixed_mc_file, **kw)
    result = train_calm(config, tmp_path / "a", progress=False)
    adapter = CalibrationAdapter.from_pretrained(result.out)
    written = result.out
    if mode == "letter" and not adapter.method["daca"]["kept"]:
        # the tiny random model's letters seldom agree with its own base on 6 questions:
        # letter mode's T is a head temperature, written as the fit would write it
        assert "agree" in adapter.method["daca"]["reason"]
        adapter = dataclasses.replace(adapter, temperature=1.7, created_at=None)
        adapter.save_pretrained(tmp_path / "written")
        written = tmp_path / "written"
    else:
        assert adapter.method["daca"]["kept"], adapter.method["daca"]
    without_t = dataclasses.replace(adapter, temperature=1.0, answer_temperature=None,
                                    created_at=None)
    without_t.save_pretrained(tmp_path / "without")
    records = calm_data.load_records((f"{mixed_mc_file}:all",), labeled=True)[0]
    read = finish_module.measure_parts(config, records, {"written": written,
                                                         "trained": tmp_path / "without"},
                                       progress=False)["parts"]
    assert read["written"]["prediction"] == read["trained"]["prediction"]
    # and T did change the probabilities
    assert read["written"]["confidence"] != read["trained"]["confidence"]


def test_the_temperature_is_the_fit_of_the_written_lora_and_alpha(ungated, tmp_path):
    """Refitting on the adapter without its T gives the same T: the fit reads what the
    runtime reads (the LoRA merged, α in the head), nothing else."""
    config, result = ungated
    adapter = CalibrationAdapter.from_pretrained(result.out)
    before = dataclasses.replace(adapter, temperature=1.0, answer_temperature=None,
                                 created_at=None)
    before.save_pretrained(tmp_path / "before")
    records = calm_data.load_records(config.calibration, labeled=False)[0]
    again, record = finish_module.fit_base_temperature(config, tmp_path / "before", records,
                                                       progress=False)
    assert again.answer_temperature == pytest.approx(adapter.answer_temperature, rel=1e-6)
    assert again.temperature == pytest.approx(adapter.temperature, rel=1e-6)


def test_each_part_is_read_on_the_reporting_half(trained):
    _, result = trained
    adapter = CalibrationAdapter.from_pretrained(result.out)
    parts = adapter.metrics["holdout_parts"]
    gate = adapter.method["alpha_gate"]
    assert parts["n"] == gate["holdout"]["n"] == parts["deciding"] + parts["reporting"]
    assert parts["deciding"] == gate["share"]["n"] == gate["holdout"]["deciding"]
    assert parts["read_on"] == "reporting"
    assert list(parts["parts"]) == list(finish_module.PART_NAMES)
    for row in parts["parts"].values():
        assert 0 <= row["accuracy"] <= 1 and 0 <= row["ece"] <= 1 and row["nll"] > 0
    for q in parts["questions"].values():
        assert len(q["correct"]) == parts["n"]
    # with the identity written, "lora" and "lora+alpha" are the same reading
    if not gate["kept"]:
        assert parts["parts"]["lora"]["nll"] == pytest.approx(parts["parts"]["lora+alpha"]["nll"])
    lines = finish_module.part_lines(result.daca, parts)
    assert lines[0].startswith("  DACA against the model before the LoRA")
    assert any(line.strip().startswith(("T kept", "T dropped")) for line in lines)
    assert [line.split()[0] for line in lines[-4:]] == list(finish_module.PART_NAMES)


def test_export_fuses_lora_alpha_and_t_in_one_step(ungated, tiny_llama_tied, tmp_path):
    pytest.importorskip("onnxruntime")
    from calm_export.config import ExportConfig
    from calm_export.pipeline import export_engine
    from calm_runtime.formats.engine import EngineManifest

    _, result = ungated
    adapter = CalibrationAdapter.from_pretrained(result.out)
    engine = export_engine(tiny_llama_tied, tmp_path / "engine", adapter=result.out,
                           config=ExportConfig(progress=False, graph="fused"))
    manifest = EngineManifest.load(engine.path)
    calibration = manifest.calibration
    assert calibration["adapter_kind"] == "calm+daca"
    assert calibration["temperature"] == pytest.approx(adapter.temperature)
    assert manifest.answer_temperature == pytest.approx(adapter.answer_temperature)


def test_no_daca_and_a_failed_fit_keep_the_trained_adapter(tiny_llama_tied, mc_file, tmp_path,
                                                          monkeypatch):
    config = _config(tiny_llama_tied, mc_file, daca=False)
    train_calm(config, tmp_path / "plain", progress=False)
    plain = CalibrationAdapter.from_pretrained(tmp_path / "plain")
    assert plain.method["daca"] == {"fitted": False, "reason": "--no-daca", "kept": False}
    assert plain.temperature == 1.0 and plain.answer_temperature is None
    assert plain.kind == "calm"

    def fails(*args, **kwargs):
        raise FitError("no question where both models agree")

    monkeypatch.setattr(finish_module, "fit_base_temperature", fails)
    result = train_calm(_config(tiny_llama_tied, mc_file), tmp_path / "failed", progress=False)
    kept = CalibrationAdapter.from_pretrained(tmp_path / "failed")
    assert kept.method["daca"]["fitted"] is False
    assert "no question where both models agree" in kept.method["daca"]["reason"]
    assert kept.lora_path is not None and "holdout_parts" in kept.metrics
    assert result.daca["fitted"] is False
    assert not (tmp_path / "failed.checkpoints").exists()  # the final checkpoint is removed


def test_a_failing_measurement_keeps_the_finished_training_for_resume(
        tiny_llama_tied, mc_file, tmp_path, monkeypatch):
    from calm_training.methods.calm import trainer

    def broken(self):
        raise ValueError("all input arrays must have the same shape")

    monkeypatch.setattr(trainer._Trainer, "_alpha_gate", broken)
    config = _config(tiny_llama_tied, mc_file, daca=False)
    with pytest.raises(FitError, match="rerun the same command with --resume"):
        train_calm(config, tmp_path / "a", progress=False)
    assert not (tmp_path / "a").exists()
    assert trainer.latest_checkpoint(tmp_path / "a.checkpoints").name == "step-000002"
    monkeypatch.undo()
    result = train_calm(config, tmp_path / "a", resume=True, progress=False)
    assert result.out.is_dir() and result.history[-1]["step"] == 2


def test_an_adapter_whose_run_stopped_before_t_says_so_and_resume_finishes_it(
        tiny_llama_tied, mixed_mc_file, tmp_path, monkeypatch):
    # a run killed in the temperature fit (out of memory) leaves the trained adapter on disk:
    # its manifest says T is pending, and --resume --overwrite finishes it from the checkpoint
    config = _config(tiny_llama_tied, mixed_mc_file)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # stands for the process dying: nothing after it runs

    monkeypatch.setattr(finish_module, "finish", killed)
    with pytest.raises(KeyboardInterrupt):
        train_calm(config, tmp_path / "a", progress=False)
    stopped = CalibrationAdapter.from_pretrained(tmp_path / "a")
    assert stopped.method["daca"]["pending"] is True
    assert stopped.method["daca"]["kept"] is False
    assert "--resume --overwrite" in stopped.method["daca"]["reason"]
    monkeypatch.undo()
    result = train_calm(config, tmp_path / "a", resume=True, overwrite=True, progress=False)
    done = CalibrationAdapter.from_pretrained(result.out)
    assert "pending" not in done.method["daca"] and done.method["daca"]["fitted"] is True
    assert done.metrics["holdout_parts"]["n"] == stopped.method["alpha_gate"]["holdout"]["n"]
