"""Open QA: generated answers, P(True) judgements and their calibration on tiny models."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from calm_runtime.data.models import load_model_and_tokenizer  # noqa: E402
from calm_runtime.data.prompts import p_true_template  # noqa: E402
from calm_runtime.errors import DataError  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter  # noqa: E402
from calm_training.fit import compare_methods, fit_adapter  # noqa: E402
from calm_training.posthoc.fit_config import FitConfig  # noqa: E402
from calm_training.posthoc.plan import FitPlan  # noqa: E402
from calm_training.scoring import judgements  # noqa: E402
from calm_training.scoring.answers import score_p_true  # noqa: E402


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def qa_file(tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [{"question": f"what is item {i}?", "answers": [f"item {i}", "thing"]}
            for i in range(24)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_p_true_comparison_and_adapter(tiny_llama_tied, tiny_llama_untied, qa_file, tmp_path,
                                       monkeypatch):
    config = FitConfig(model=str(tiny_llama_tied), reference=str(tiny_llama_untied),
                       data=str(qa_file), mode="p_true", bootstrap=0, chat=False)
    judged = FitPlan.resolve(config).judgements(progress=False)
    assert len(judged["answers"]) == 24 and judged["polm"].shape == (24, 2)
    model, tokenizer, _ = load_model_and_tokenizer(str(tiny_llama_tied))
    direct = score_p_true(model, tokenizer, ["what is item 3?"], [judged["answers"][3]],
                          p_true_template("kadavath"), chat=False, progress=False)
    np.testing.assert_allclose(judged["polm"][3], direct[0], atol=1e-5)

    report = compare_methods(config, ("vanilla", "naive", "daca"), progress=False)
    assert set(report["methods"]) == {"vanilla", "naive", "daca"}
    assert 0.0 <= report["agreement_rate"] <= 1.0
    t = report["methods"]["daca"]["fit"]["temperature"]
    adapter, _ = fit_adapter(config, "daca", tmp_path / "pt", progress=False)
    loaded = CalibrationAdapter.from_pretrained(tmp_path / "pt")
    assert loaded.temperature == pytest.approx(t)
    assert loaded.p_true_template["name"] == "kadavath"
    assert loaded.kind == "daca_p_true"

    def boom(*_a, **_k):
        raise AssertionError("answers and judgements must come from the cache")

    monkeypatch.setattr(judgements, "generate_answers", boom)
    monkeypatch.setattr(judgements, "score_p_true", boom)
    assert FitPlan.resolve(config).judgements(progress=False)["answers"] == judged["answers"]


def test_p_true_mode_needs_open_qa_data(tiny_llama_tied, tmp_path):
    mc = tmp_path / "mc.jsonl"
    mc.write_text('{"question": "q", "choices": ["a", "b"], "answer": 0}\n')
    config = FitConfig(model=str(tiny_llama_tied), data=str(mc), mode="p_true")
    with pytest.raises(DataError, match="open-QA"):
        compare_methods(config, ("vanilla",), progress=False)


def test_platt_recovers_a_known_slope_and_bias():
    """Labels drawn from sigmoid(2 d - 1): the fit finds slope 2 and bias -1 (it can move
    the base rate, which a temperature cannot)."""
    import numpy as np

    from calm_training.methods.platt import fit_platt

    rng = np.random.default_rng(0)
    d = rng.normal(0, 2, 20_000)
    correct = (rng.random(d.size) < 1 / (1 + np.exp(-(2 * d - 1)))).astype(float)
    two_way = np.stack([d, np.zeros_like(d)], axis=1)
    fit = fit_platt(two_way, correct)
    assert fit.slope == pytest.approx(2.0, rel=0.05) and fit.bias == pytest.approx(-1, abs=0.08)
    assert fit.temperature == pytest.approx(0.5, rel=0.05)
    p = fit.apply(two_way)
    assert abs(p.mean() - correct.mean()) < 0.01
