"""`calm eval --compare`'s reading lines: advice only where the intervals decide it; a
warning about a tiny agreement set once, not once per fit that shares it."""

from __future__ import annotations

import logging

import numpy as np

from calm_training.methods.daca import agreement_set
from calm_training.posthoc.fit_report import paired_ece_difference, readings


def _row(conf, correct, accuracy=None):
    return {"confidence": list(map(float, conf)), "correct": list(map(int, correct)),
            "accuracy": float(np.mean(correct)) if accuracy is None else accuracy}


def _report(rows, n):
    return {"methods": rows, "config": {"n_bins": 10}, "n_test": n}


def test_a_difference_the_interval_holds_zero_for_is_not_a_verdict():
    rng = np.random.default_rng(0)
    correct = (rng.uniform(size=40) < 0.5).astype(int)
    a = rng.uniform(0.3, 0.9, 40)
    b = np.clip(a + rng.normal(0, 0.01, 40), 0, 1)
    lines = readings(_report({"vanilla": _row(a, correct), "daca": _row(b, correct)}, 40))
    assert lines[0].startswith("reading (paired bootstrap over the 40 test questions")
    assert "cannot tell daca from vanilla" in lines[1]


def test_a_clear_difference_is_read_with_its_direction():
    rng = np.random.default_rng(1)
    n = 400
    correct = (rng.uniform(size=n) < 0.5).astype(int)
    over = np.full(n, 0.95)  # says 95% on a coin: ECE 0.45
    honest = np.full(n, 0.5) + rng.normal(0, 0.01, n)
    lines = readings(_report({"vanilla": _row(over, correct), "ts": _row(honest, correct)}, n))
    assert "ts's ECE is lower than vanilla's" in lines[1]
    delta, low, high = paired_ece_difference(_row(honest, correct), _row(over, correct), 10)
    assert high < 0 and low <= delta <= high


def test_vector_variants_that_change_answers_and_empty_selective_rows_are_explained():
    correct = np.array([1, 0, 1, 0])
    rows = {"vanilla": _row([0.6, 0.7, 0.8, 0.9], correct),
            "ts": _row([0.3, 0.4, 0.4, 0.45], correct),
            "ts-vector": _row([0.6, 0.7, 0.8, 0.9], correct, accuracy=0.25)}
    lines = readings(_report(rows, 4), n_resamples=50)
    assert any(line.startswith("ts-vector changes answers (accuracy 0.500 -> 0.250)")
               for line in lines), lines
    assert any(line.startswith("ts keeps no answer at confidence >= 0.5 (its highest is 0.450)")
               for line in lines), lines


def test_a_tiny_agreement_set_is_warned_about_once(caplog):
    caplog.set_level(logging.WARNING, logger="calm_training.methods.daca")
    rng = np.random.default_rng(7)
    f, g = rng.normal(size=(9, 4)), rng.normal(size=(9, 4))
    for _ in range(2):  # DACA and its vector variant fit on the same agreement set
        agreement_set(f, g, True, 50, 0.9)
    warned = [r for r in caplog.records if "agreement set is tiny" in r.getMessage()]
    assert len(warned) == 1
