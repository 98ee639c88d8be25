"""``calm train`` ends calibrated (calm_training.calm.finish): a DACA temperature of the
trained model against the model before the LoRA, written into the same adapter with what each
part did on the held-out training questions; ``calm-export`` fuses all of it in one step."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from calm_runtime.errors import FitError  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter  # noqa: E402
from calm_training.calm import data as calm_data  # noqa: E402
from calm_training.calm import finish as finish_module  # noqa: E402
from calm_training.calm.trainer import CalmConfig, train_calm  # noqa: E402

pytestmark = pytest.mark.usefixtures("private_calm_cache")


def _config(model, data, **kw):
    return CalmConfig(**{"model": str(model), "train": (f"{data}:train",),
                         "calibration": (f"{data}:unlabeled",), "steps": 2,
                         "warm_start_steps": 1, "batch_size": 2, "lora_rank": 4,
                         "max_length": 64, "alpha_holdout": 0.3, **kw})


@pytest.fixture(scope="module")
def trained(tiny_llama_tied, mixed_mc_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("finish") / "calm"
    config = _config(tiny_llama_tied, mixed_mc_file)
    return config, train_calm(config, out, progress=False)


def test_the_adapter_carries_a_daca_temperature_against_the_base(trained):
    config, result = trained
    adapter = CalibrationAdapter.from_pretrained(result.out)
    record = adapter.method["daca"]
    assert record["fitted"], record
    assert adapter.kind == "calm+daca"
    assert record["reference"] == "the model before the LoRA"
    assert record["reference_identity"]["name"] == adapter.base_model.name
    fit = record["fit"]
    assert fit["method"] == "daca" and 0 < fit["agreement_rate"] <= 1
    n_cal = len(calm_data.load_records(config.calibration, labeled=False)[0])
    assert fit["n"] == record["n_questions"] <= n_cal  # the unlabeled calibration set
    # cloze: the option temperature is the answer temperature; a head temperature when the
    # answer positions carry a signal (the token-level fit records why not, otherwise)
    assert adapter.answer_temperature == pytest.approx(fit["temperature"])
    assert adapter.temperature == pytest.approx(record["temperature"])
    assert record["token_fit"] is not None
    # the training's own record stays: settings, the gate
    assert adapter.method["name"] == "calm" and "alpha_gate" in adapter.method
    assert result.daca == {**record}


def test_the_temperature_is_the_fit_of_the_written_lora_and_alpha(trained, tmp_path):
    """Refitting on the adapter without its T gives the same T: the fit reads what the
    runtime reads (the LoRA merged, α in the head), nothing else."""
    config, result = trained
    adapter = CalibrationAdapter.from_pretrained(result.out)
    before = dataclasses.replace(adapter, temperature=1.0, answer_temperature=None,
                                 created_at=None)
    before.save_pretrained(tmp_path / "before")
    records = calm_data.load_records(config.calibration, labeled=False)[0]
    again, record = finish_module.fit_base_temperature(config, tmp_path / "before", records,
                                                       progress=False)
    assert again.answer_temperature == pytest.approx(adapter.answer_temperature, rel=1e-6)
    assert again.temperature == pytest.approx(adapter.temperature, rel=1e-6)


def test_each_part_is_read_on_the_hold_out(trained):
    _, result = trained
    adapter = CalibrationAdapter.from_pretrained(result.out)
    parts = adapter.metrics["holdout_parts"]
    gate = adapter.method["alpha_gate"]
    assert parts["n"] == gate["share"]["n"] == gate["holdout"]["n"]
    assert list(parts["parts"]) == list(finish_module.PART_NAMES)
    for row in parts["parts"].values():
        assert 0 <= row["accuracy"] <= 1 and 0 <= row["ece"] <= 1 and row["nll"] > 0
        assert len(row["questions"]["correct"]) == parts["n"]
    # with the identity written, "lora" and "lora+alpha" are the same reading
    if not gate["kept"]:
        assert parts["parts"]["lora"]["nll"] == pytest.approx(parts["parts"]["lora+alpha"]["nll"])
    lines = finish_module.part_lines(result.daca, parts)
    assert lines[0].startswith("  DACA against the model before the LoRA")
    assert [line.split()[0] for line in lines[-4:]] == list(finish_module.PART_NAMES)


def test_export_fuses_lora_alpha_and_t_in_one_step(trained, tiny_llama_tied, tmp_path):
    pytest.importorskip("onnxruntime")
    from calm_export.config import ExportConfig
    from calm_export.pipeline import export_engine
    from calm_runtime.formats.engine import EngineManifest

    _, result = trained
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
    assert plain.method["daca"] == {"fitted": False, "reason": "--no-daca"}
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
    from calm_training.calm import trainer

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
