"""Abstention: the threshold's risk bound, its choice, and its way from the adapter through the
engine to the runtime's choices."""

from __future__ import annotations

import numpy as np
import pytest

from calm_runtime.errors import ArtifactError, FitError
from calm_training.methods.threshold import binomial_upper_bound, fit_threshold


def test_clopper_pearson_upper_bound_matches_the_beta_quantile():
    stats = pytest.importorskip("scipy.stats")
    for errors, n in [(0, 10), (1, 100), (5, 50), (30, 40), (0, 1), (7, 7)]:
        want = 1.0 if errors >= n else stats.beta.ppf(0.95, errors + 1, n - errors)
        assert binomial_upper_bound(errors, n, 0.95) == pytest.approx(want, abs=1e-9)
    assert binomial_upper_bound(0, 10, 0.95) == pytest.approx(1 - 0.05 ** (1 / 10))


def test_threshold_is_the_lowest_grid_point_whose_bonferroni_bound_passes():
    from calm_training.methods.threshold import GRID

    # 60 confident right answers (one wrong at the very top), a band where half are wrong,
    # then mostly wrong: one bad answer at the top must not stop the choice
    conf = np.r_[0.995, np.linspace(0.99, 0.80, 60), np.linspace(0.79, 0.60, 40),
                 np.linspace(0.59, 0.30, 50)]
    correct = np.r_[0.0, np.ones(60), np.tile([1.0, 0.0], 20), np.r_[np.ones(5), np.zeros(45)]]
    fit = fit_threshold(conf, correct, risk=0.15, confidence=0.95)
    delta = 0.05 / len(GRID)
    assert fit.threshold in GRID and fit.risk_upper_bound <= 0.15
    kept = conf >= fit.threshold
    errors = int(kept.sum() - correct[kept].sum())
    assert (fit.n_kept, fit.selective_risk) == (kept.sum(), errors / kept.sum())
    assert fit.risk_upper_bound == pytest.approx(
        binomial_upper_bound(errors, int(kept.sum()), 1 - delta))
    for lower in (g for g in GRID if g < fit.threshold):  # every lower grid point fails
        kept = conf >= lower
        assert binomial_upper_bound(int(kept.sum() - correct[kept].sum()), int(kept.sum()),
                                    1 - delta) > 0.15
    assert fit.threshold == 0.8
    looser = fit_threshold(conf, correct, risk=0.3, confidence=0.95)
    assert looser.threshold < fit.threshold and looser.coverage > fit.coverage
    with pytest.raises(FitError, match="no threshold of the grid keeps the selective risk"):
        fit_threshold(conf[61:], correct[61:], risk=0.05)


def test_the_adapter_keeps_the_threshold(tmp_path):
    from calm_runtime import CalibrationAdapter, ModelIdentity

    adapter = CalibrationAdapter.identity(ModelIdentity("m", 8),
                                          abstention={"threshold": 0.7, "risk": 0.1})
    adapter.save_pretrained(tmp_path / "a")
    assert CalibrationAdapter.from_pretrained(tmp_path / "a").abstention == {
        "threshold": 0.7, "risk": 0.1}
    with pytest.raises(ArtifactError, match="abstention.threshold must be a number in"):
        CalibrationAdapter.identity(ModelIdentity("m", 8), abstention={"threshold": 1.5})


def test_fit_threshold_to_engine_to_choices(tiny_llama_tied, mc_file, tmp_path):
    """calm fit threshold writes it, calm-export carries it and the mode it was fitted in,
    the runtime marks choices."""
    pytest.importorskip("onnxruntime")
    from calm_export.config import ExportConfig
    from calm_export.pipeline import export_engine
    from calm_runtime import CalibratedLM
    from calm_runtime.data.sets import load_dataset
    from calm_training.fit import fit_adapter
    from calm_training.posthoc.fit_config import FitConfig

    config = FitConfig(model=str(tiny_llama_tied), data=str(mc_file), mode="cloze",
                       risk=0.99, risk_confidence=0.5, bootstrap=0)
    adapter, report = fit_adapter(config, "threshold", tmp_path / "adapter", progress=False)
    threshold = adapter.abstention["threshold"]
    assert report["fit"]["threshold"] == threshold and report["test_split"]["n"] > 0
    export_engine(tiny_llama_tied, tmp_path / "engine", adapter=tmp_path / "adapter",
                  config=ExportConfig(greedy_steps=2, progress=False, exporter="torchscript"))
    lm = CalibratedLM.load(tmp_path / "engine", threads=1)
    assert lm.abstain_below == pytest.approx(threshold)
    assert lm.manifest.export["choice_mode"] == lm.choice_mode == "cloze"
    records = load_dataset(str(mc_file))[:8]
    choices = lm.choose_batch([r.question for r in records], [r.choices for r in records],
                              lm.choice_mode)
    for choice in choices:
        assert choice.abstained == (choice.confidence < threshold)
    lm.close()


def test_the_engine_records_the_mode_its_calibration_was_fitted_in():
    """The adapter's ``choice_mode`` (which calm-export records): the threshold's mode, else
    the fit's; the runtime reads it, and falls back to the abstention's mode (older engines),
    else cloze."""
    from types import SimpleNamespace

    from calm_runtime.formats.artifact import CalibrationAdapter, ModelIdentity
    from calm_runtime.inference.lm import recorded_choice_mode

    def adapter(abstention, method):
        return CalibrationAdapter.identity(ModelIdentity("m", 8), abstention=abstention,
                                           method=method)

    assert adapter({"threshold": 0.5, "mode": "letter"}, {"mode": "cloze"}).choice_mode \
        == "letter"
    assert adapter(None, {"mode": "letter"}).choice_mode == "letter"
    assert adapter(None, {"mode": "p_true"}).choice_mode is None
    assert adapter(None, {}).choice_mode is None
    assert adapter(None, {"variant": "sum"}).cloze_variant == "sum"
    assert adapter(None, {"variant": "nope"}).cloze_variant is None
    manifest = SimpleNamespace
    assert recorded_choice_mode(manifest(export={"choice_mode": "letter"})) == "letter"
    assert recorded_choice_mode(manifest(export={"abstention": {"mode": "letter"}})) == "letter"
    assert recorded_choice_mode(manifest(export={"choice_mode": None})) is None
    assert recorded_choice_mode(manifest(export=None)) is None


def test_a_risk_out_of_reach_names_the_lowest_one_the_data_carries():
    """30 answers, half right: no threshold can promise 0.3; the error says which risk these
    answers do carry (the next 0.05 above the lowest bound), and that more data lowers it."""
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.3, 1.0, 30)
    correct = (rng.uniform(size=30) < 0.5).astype(float)
    with pytest.raises(FitError) as caught:
        fit_threshold(conf, correct, risk=0.3)
    message = str(caught.value)
    bound = float(message.split("the lowest bound they carry is ")[1].split(")")[0])
    offered = float(message.split("allow --risk ")[1].split(" ")[0])
    assert bound <= offered < bound + 0.05 + 1e-9
    assert fit_threshold(conf, correct, risk=offered).risk_upper_bound <= offered
    assert "more labelled calibration data" in message
