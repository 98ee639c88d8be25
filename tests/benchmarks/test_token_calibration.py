"""benchmarks/token_calibration.py and its resampling helpers (benchmarks/_common.py):
intervals that resample questions, not the positions clustered inside them, an interval for
every fitted temperature, and counts that say what the fit used."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def common(benchmark_scripts):
    with benchmark_scripts("_common") as module:
        yield module


@pytest.fixture()
def bench(common, benchmark_scripts):
    pytest.importorskip("torch")
    with benchmark_scripts("token_calibration") as module:
        yield module


def test_cluster_resamples_draw_whole_clusters(common):
    clusters = np.array([0, 0, 0, 1, 2, 2, 4])  # cluster 3 has no rows; 5 clusters in all
    for weights in common.cluster_resamples(clusters, 5, n_resamples=50, seed=3):
        assert weights[0] == weights[1] == weights[2] and weights[4] == weights[5]
        assert weights.sum() <= 3 * 5 and (weights >= 0).all()
    with pytest.raises(ValueError):
        next(common.cluster_resamples(clusters, 4, n_resamples=1))


def test_clustered_interval_is_as_wide_as_the_questions_allow(common):
    """Four identical positions per question: resampling positions pretends to four times
    the data (an interval about half as wide); resampling questions gives the interval of
    the per-question values."""
    rng = np.random.default_rng(0)
    per_question = rng.normal(size=100)
    values = np.repeat(per_question, 4)
    clusters = np.repeat(np.arange(100), 4)
    low, high = common.cluster_bootstrap_interval(np.mean, clusters, values, n_resamples=400)
    plow, phigh = common.cluster_bootstrap_interval(np.mean, np.arange(400), values,
                                                    n_resamples=400)
    qlow, qhigh = common.cluster_bootstrap_interval(np.mean, np.arange(100), per_question,
                                                    n_resamples=400)
    assert phigh - plow < 0.65 * (high - low)
    assert abs((high - low) - (qhigh - qlow)) < 0.25 * (qhigh - qlow)


def test_temperature_interval_matches_refitting_each_resample(common):
    """The grid solve of each resample equals calm's own solver refitted on the resampled
    rows (rows repeated as often as their question was drawn)."""
    ts = pytest.importorskip("calm_training.methods.ts")
    rng = np.random.default_rng(1)
    rows, vocab = 90, 200
    logits = rng.normal(size=(rows, vocab)) * 3
    targets = rng.integers(0, vocab, size=rows)
    targets[:50] = logits[:50].argmax(1)
    owner = np.repeat(np.arange(30), 3)
    fit = ts.fit_token_temperature_scaling(logits, targets)
    scores = logits[np.arange(rows), targets]
    out = common.temperature_interval(logits, scores, owner, temperature=fit.temperature,
                                      n_clusters=30, n_resamples=60, seed=7)
    assert out["refit"] == pytest.approx(fit.temperature, rel=1e-6)
    exact = []
    for weights in common.cluster_resamples(owner, 30, n_resamples=60, seed=7):
        idx = np.repeat(np.arange(rows), weights)
        exact.append(ts.fit_token_temperature_scaling(logits[idx], targets[idx]).temperature)
    assert out["ci95"] == pytest.approx(list(np.percentile(exact, [2.5, 97.5])), rel=2e-3)
    assert out["beyond_grid"] == 0 and out["resamples"] == 60


def test_fit_rows_are_the_rows_the_token_fit_minimises(bench, tiny_llama_tied, tiny_lora_tied,
                                                      tmp_path):
    """The benchmark rebuilds the fit's rows to resample them: on them the grid refit gives
    the temperature ``token_level_fit`` fitted, and their count is its ``n_used``."""
    from conftest import write_mc_jsonl

    from calm_runtime.data.models import load_model_and_tokenizer
    from calm_runtime.data.sets import load_dataset
    from calm_training.methods import fit_method
    from calm_training.posthoc.token_fit import token_level_fit

    records = load_dataset(str(write_mc_jsonl(tmp_path / "mc.jsonl", n=12)))
    labels = np.array([r.answer for r in records])
    chosen = (labels + np.arange(12) % 2) % 4
    agree = np.arange(12) % 3 != 0
    lm, tokenizer, _ = load_model_and_tokenizer(tiny_llama_tied, lora_path=tiny_lora_tied)
    ref, ref_tokenizer, _ = load_model_and_tokenizer(tiny_llama_tied)
    for method in ("daca", "ts"):
        fit, record = token_level_fit(fit_method(method), model=lm, tokenizer=tokenizer,
                                      records=records, chosen=chosen, reference=ref,
                                      reference_tokenizer=ref_tokenizer, same_tokenizer=True,
                                      labels=labels, agree=agree)
        logits, scores, owner = bench._fit_rows(method, lm, tokenizer, str(tiny_llama_tied),
                                                records, chosen, agree, labels, None)
        assert len(scores) == record["n_used"] == len(logits) == len(owner)
        assert set(owner) <= set(range(12))
        if method == "daca":
            assert set(owner) <= set(np.flatnonzero(agree))
        else:  # labeled: every answer position of every fit question
            assert set(owner) == set(range(12)) and len(scores) == record["positions"]
        out = bench.fit_interval(logits, scores, owner, fit, 12, 20)
        if fit.at_bound is not None:  # random tiny models: labeled T can be infinite
            assert "skipped" in out
            continue
        assert out["refit"] == pytest.approx(fit.temperature, rel=1e-6)
        assert out["ci95"][0] <= out["ci95"][1]


def _row(**extra) -> dict:
    metrics = {"temperature": 1.0, "ece": 0.1, "ece_ci95": [0.05, 0.15], "accuracy": 0.4,
               "mean_confidence": 0.5, "nll": 3.0}
    return {"pair": "a vs b", "method": "daca", "fit_data": "x:unlabeled",
            "token_fit": {"fitted": True, "method": "daca_token", "positions": 30,
                          "questions": 8, "n": 10, "n_used": 20, "temperature": 1.3},
            "test_positions": 100, "test_questions": 25, "before": metrics,
            "after": {**metrics, "temperature": 1.3}, **extra}


def test_render_says_what_was_resampled_and_used(bench):
    new = {"command": "python benchmarks/token_calibration.py", "commit": "abc", "created": "now",
           "seconds": 1.0, "n_bins": 10, "interval_unit": "questions",
           "rows": [_row(fit_questions=10, temperature_interval={"ci95": [1.1, 1.6]})]}
    text = bench.render(new)
    assert "resample test questions" in text and "Stale" not in text
    assert "| 1.300 [1.100, 1.600] |" in text and "| 10 → 8 → 30 → 20 |" in text
    assert "| 25 / 100 |" in text
    old = {**new, "rows": [_row()]}
    del old["interval_unit"]
    text = bench.render(old)
    assert "Stale" in text and "1.300 (no interval)" in text and "| 10 → 8 → 30 → 20 |" in text


def test_committed_file_is_rendered_from_its_json(bench):
    """The committed .md is what --render makes of the committed .json (stale or not, it
    says which intervals it holds)."""
    results = BENCHMARKS / "results"
    payload = json.loads((results / "token_calibration.json").read_text())
    assert (results / "token_calibration.md").read_text() == bench.render(payload)


@pytest.mark.usefixtures("private_calm_cache")
def test_run_arm_records_question_intervals_and_counts(bench, tiny_llama_tied, tmp_path):
    """One labeled arm end to end on a tiny model: the row holds the used counts, the T
    interval (or why there is none) and ECE intervals over test questions."""
    from conftest import write_mc_jsonl

    data = write_mc_jsonl(tmp_path / "mc.jsonl", n=30)
    row = bench.run_arm("tiny", str(tiny_llama_tied), None, None, "ts", f"{data}:calibration",
                        f"{data}:test", 30)
    assert row["fit_questions"] == 9 and row["test_questions"] == 21
    assert row["fit_positions_used"] == row["token_fit"]["n_used"]
    assert "ci95" in row["temperature_interval"] or "skipped" in row["temperature_interval"]
    for key in ("before", "after"):
        low, high = row[key]["ece_ci95"]
        assert low <= row[key]["ece"] <= high or low <= high
    line = bench.render({"command": "c", "commit": "x", "created": "now", "seconds": 1.0,
                         "n_bins": 10, "interval_unit": "questions", "rows": [row]})
    assert "| 9 → 9 → " in line and "| 21 / " in line
