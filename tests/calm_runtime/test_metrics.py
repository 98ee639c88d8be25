"""Known-answer and cross-check tests for calm_runtime.measure.metrics and
calm_runtime.measure.plot."""

from __future__ import annotations

import functools
import math
import subprocess
import sys

import numpy as np
import pytest

from calm_runtime.errors import BackendUnavailableError, ConfigError
from calm_runtime.measure.metrics import (
    accuracy,
    aece,
    binary_report,
    bootstrap_interval,
    brier,
    calibration_report,
    ece,
    mce,
    nll,
    reliability_bins,
)
from calm_runtime.measure.plot import write_reliability_diagram

# A hand-checkable case with 4 equal-width bins (edges 0, .25, .5, .75, 1 are exact floats).
CONF = np.array([0.0, 0.2, 0.25, 0.6, 0.8, 1.0, 1.0, 0.9])
CORRECT = np.array([0, 0, 1, 1, 1, 1, 0, 1])
# bin 1 [0, .25]:  0.0, 0.2, 0.25 -> n=3, conf=.45/3=.15, acc=1/3, gap=1/3-.15=.18333...
# bin 2 (.25, .5]: empty
# bin 3 (.5, .75]: 0.6            -> n=1, conf=.6, acc=1, gap=.4
# bin 4 (.75, 1]:  .8, 1, 1, .9   -> n=4, conf=3.7/4=.925, acc=3/4, gap=.175
# ECE = 3/8 * .18333 + 1/8 * .4 + 4/8 * .175 = .06875 + .05 + .0875 = .20625
# MCE = max(.18333, .4, .175) = .4 (the empty bin is skipped)
HAND_ECE = 0.20625
HAND_MCE = 0.4


def test_uniform_bins_hand_case():
    bins = reliability_bins(CONF, CORRECT, n_bins=4)
    np.testing.assert_array_equal(bins.count, [3, 0, 1, 4])
    np.testing.assert_allclose(bins.lower, [0.0, 0.25, 0.5, 0.75])
    np.testing.assert_allclose(bins.upper, [0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(bins.confidence, [0.15, np.nan, 0.6, 0.925])
    np.testing.assert_allclose(bins.accuracy, [1 / 3, np.nan, 1.0, 0.75])
    assert bins.n == 8 and bins.n_bins == 4
    assert ece(CONF, CORRECT, n_bins=4) == pytest.approx(HAND_ECE, abs=1e-12)
    assert mce(CONF, CORRECT, n_bins=4) == pytest.approx(HAND_MCE, abs=1e-12)


def test_bins_are_read_only():
    bins = reliability_bins(CONF, CORRECT, n_bins=4)
    with pytest.raises(ValueError):
        bins.count[0] = 99


def test_zero_and_one_land_in_first_and_last_bins():
    # 0.0 joins the first bin (0, .1]; 1.0 is the upper edge of the last bin (.9, 1].
    bins = reliability_bins([0.0, 1.0], [0, 1], n_bins=10)
    assert bins.count[0] == 1 and bins.count[-1] == 1 and bins.n == 2
    # Both perfectly calibrated: conf 0 with acc 0, conf 1 with acc 1 -> ECE 0.
    assert ece([0.0, 1.0], [0, 1]) == 0.0


def test_values_on_edges_go_to_the_lower_bin():
    # Bin b holds ((b-1)/10, b/10]: 0.0 and 0.1 share bin 1, then each k/10 ends bin k.
    # Float literals like 0.3 equal the edge 3/10 exactly (both are correctly rounded).
    values = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    bins = reliability_bins(values, [1] * 11, n_bins=10)
    np.testing.assert_array_equal(bins.count, [2, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    # A value just above an edge starts the next bin.
    assert reliability_bins([np.nextafter(0.3, 1.0)], [1]).count[3] == 1


def test_single_bin_ece_is_gap_of_means():
    # One bin: ECE = MCE = |mean(correct) - mean(conf)| = |2/3 - (0.5+0.7+0.9)/3| = |.6667-.7|
    assert ece([0.5, 0.7, 0.9], [1, 0, 1], n_bins=1) == pytest.approx(1 / 30)
    assert mce([0.5, 0.7, 0.9], [1, 0, 1], n_bins=1) == pytest.approx(1 / 30)


def test_adaptive_bins_hand_case():
    # Sorted: (0,0) (.2,0) | (.25,1) (.6,1) | (.8,1) (.9,1) | (1,1) (1,0); 4 bins of 2.
    # gaps: |0-.1|=.1, |1-.425|=.575, |1-.85|=.15, |.5-1|=.5 -> AECE = 1.325/4 = .33125
    assert aece(CONF, CORRECT, n_bins=4) == pytest.approx(0.33125, abs=1e-12)
    bins = reliability_bins(CONF, CORRECT, n_bins=4, scheme="adaptive")
    np.testing.assert_array_equal(bins.count, [2, 2, 2, 2])
    np.testing.assert_allclose(bins.lower, [0.0, 0.25, 0.8, 1.0])
    np.testing.assert_allclose(bins.upper, [0.2, 0.6, 0.9, 1.0])


def test_adaptive_bins_uneven_and_sparse():
    # np.array_split: 5 examples into 2 bins -> sizes 3, 2 (the first bin takes the extra one).
    bins = reliability_bins([0.9, 0.1, 0.5, 0.3, 0.7], [1, 0, 1, 0, 1], n_bins=2,
                            scheme="adaptive")
    np.testing.assert_array_equal(bins.count, [3, 2])
    np.testing.assert_allclose(bins.confidence, [0.3, 0.8])  # (.1+.3+.5)/3, (.7+.9)/2
    # More bins than examples: the trailing bins are empty and ignored by the ECE.
    sparse = reliability_bins([0.2, 0.8], [0, 1], n_bins=5, scheme="adaptive")
    np.testing.assert_array_equal(sparse.count, [1, 1, 0, 0, 0])
    assert np.isnan(sparse.lower[2]) and sparse.ece == pytest.approx(0.2)  # (.2 + .2) / 2


def test_brier_multiclass_and_binary():
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])
    labels = np.array([0, 2])
    # ex 1: (.7-1)^2 + .2^2 + .1^2 = .09 + .04 + .01 = .14
    # ex 2: .1^2 + .6^2 + (.3-1)^2 = .01 + .36 + .49 = .86  -> mean .5
    assert brier(probs, labels) == pytest.approx(0.5)
    # binary form: (.9-1)^2=.01, (.2-0)^2=.04, (.5-0)^2=.25 -> .30/3 = .1
    assert brier([0.9, 0.2, 0.5], [1, 0, 0]) == pytest.approx(0.1)


def test_nll_and_accuracy():
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])
    labels = np.array([0, 2])
    # -(ln .7 + ln .3) / 2
    assert nll(probs, labels) == pytest.approx(-(math.log(0.7) + math.log(0.3)) / 2)
    # argmax = [0, 1] vs labels [0, 2] -> 1/2
    assert accuracy(probs, labels) == 0.5
    # binary: p(label) = .9, 1-.2=.8, 1-.5=.5 -> -(ln .9 + ln .8 + ln .5) / 3
    expected = -(math.log(0.9) + math.log(0.8) + math.log(0.5)) / 3
    assert nll([0.9, 0.2, 0.5], [1, 0, 0]) == pytest.approx(expected)
    # Zero probability on the label is clipped at 1e-12: -ln(1e-12) = 27.631..., finite.
    assert nll(np.array([[1.0, 0.0]]), np.array([1])) == pytest.approx(-math.log(1e-12))


def test_calibration_report_matches_parts():
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6], [0.5, 0.25, 0.25]])
    labels = np.array([0, 2, 2, 1])
    report = calibration_report(probs, labels, n_bins=5)
    conf = np.array([0.7, 0.6, 0.6, 0.5])
    correct = np.array([1, 0, 1, 0])
    assert report["accuracy"] == 0.5
    assert report["ece"] == pytest.approx(ece(conf, correct, 5))
    assert report["mce"] == pytest.approx(mce(conf, correct, 5))
    assert report["aece"] == pytest.approx(aece(conf, correct, 5))
    assert report["brier"] == pytest.approx(brier(probs, labels))
    assert report["nll"] == pytest.approx(nll(probs, labels))
    assert report["n"] == 4 and report["n_bins"] == 5
    # Bins (5): (.4,.6] holds .5,.6,.6 -> conf 1.7/3, acc 1/3; (.6,.8] holds .7 -> acc 1.
    # ECE = 3/4 * |1/3 - 1.7/3| + 1/4 * |1 - .7| = .75 * .7/3 + .075 = .175 + .075 = .25
    assert report["ece"] == pytest.approx(0.25)


def test_binary_report_uses_p_true_as_confidence():
    p_true = np.array([0.9, 0.8, 0.3, 0.1])
    labels = np.array([1, 0, 0, 0])
    report = binary_report(p_true, labels, n_bins=2)
    # Bins (2): [0, .5] holds .3, .1 (both wrong) -> conf .2, acc 0, gap .2
    #           (.5, 1] holds .9, .8 (1 right)    -> conf .85, acc .5, gap .35
    # ECE = .5*.2 + .5*.35 = .275; MCE = .35; accuracy = fraction of correct answers = 1/4
    assert report["ece"] == pytest.approx(0.275)
    assert report["mce"] == pytest.approx(0.35)
    assert report["accuracy"] == 0.25
    # Brier (binary form): (.1^2 + .8^2 + .3^2 + .1^2) / 4 = (.01+.64+.09+.01)/4 = .1875
    assert report["brier"] == pytest.approx(0.1875)
    assert report["nll"] == pytest.approx(nll(p_true, labels))


@pytest.mark.parametrize("n_bins", [5, 10, 15])
def test_ece_mce_match_netcal(n_bins):
    netcal_metrics = pytest.importorskip("netcal.metrics")
    # netcal 1.4.0 bins with np.histogramdd over np.linspace(0, 1, n+1): bins are
    # left-closed [lo, hi) (the last one closed), after clipping confidences to
    # [eps, 1-eps]. Ours are right-closed ((b-1)/n, b/n] (docs/methods.md), so the two differ
    # only for confidences exactly on an interior edge (e.g. netcal puts 0.5 with 0.55,
    # we put it with 0.45). Random continuous data has no value on an edge (checked).
    rng = np.random.default_rng(1234)
    conf = rng.uniform(0.0, 1.0, size=5000)
    correct = (rng.uniform(size=conf.size) < conf**2).astype(int)  # overconfident model
    scaled = conf * n_bins
    assert np.min(np.abs(scaled - np.round(scaled))) > 1e-9
    expected_ece = netcal_metrics.ECE(bins=n_bins).measure(conf, correct)
    expected_mce = netcal_metrics.MCE(bins=n_bins).measure(conf, correct)
    assert ece(conf, correct, n_bins) == pytest.approx(expected_ece, abs=1e-10)
    assert mce(conf, correct, n_bins) == pytest.approx(expected_mce, abs=1e-10)
    assert ece(conf, correct, n_bins) > 0.05  # a real miscalibration was measured


def test_bootstrap_is_deterministic_and_paired():
    rng = np.random.default_rng(0)
    conf = rng.uniform(size=400)
    correct = (rng.uniform(size=400) < conf).astype(int)
    metric = functools.partial(ece, n_bins=10)
    first = bootstrap_interval(metric, conf, correct, n_resamples=200, seed=7)
    second = bootstrap_interval(metric, conf, correct, n_resamples=200, seed=7)
    assert first == second
    assert first != bootstrap_interval(metric, conf, correct, n_resamples=200, seed=8)
    low, high = first
    assert 0.0 <= low < high
    # Paired resampling keeps rows together: a metric that is identically 0 when
    # computed on matching rows stays 0 in every resample.
    zero = bootstrap_interval(lambda a, b: float(np.max(np.abs(a - b))), conf, conf.copy(),
                              n_resamples=50)
    assert zero == (0.0, 0.0)
    # Constant accuracy data: every resample gives the same value.
    probs = np.tile([0.9, 0.1], (20, 1))
    assert bootstrap_interval(accuracy, probs, np.zeros(20, dtype=int)) == (1.0, 1.0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: ece([0.5, 0.6], [1]), "shape"),
        (lambda: ece([0.5, 1.2], [1, 0]), r"\[0, 1\]"),
        (lambda: ece([0.5, float("nan")], [1, 0]), "nan"),
        (lambda: ece([0.5], [2]), "0/1"),
        (lambda: ece([], []), "empty"),
        (lambda: ece([0.5], [1], n_bins=0), "n_bins"),
        (lambda: ece([0.5], [1], n_bins=2.5), "n_bins"),
        (lambda: ece([[0.5]], [1]), "1-D"),
        (lambda: reliability_bins([0.5], [1], scheme="quantile"), "scheme"),
        (lambda: brier([[0.5, 0.5]], [2]), "labels must lie"),
        (lambda: brier([[0.5, 0.5]], [0.0]), "integer"),
        (lambda: brier([[0.5, 0.5]], [0, 1]), "shape"),
        (lambda: nll([[2.0, -1.0]], [0]), r"\[0, 1\]"),
        (lambda: nll([[0.6, 0.6]], [0]), "sum to 1"),
        (lambda: accuracy([0.5, 0.6], [1, 0]), r"\[N, K\]"),
        (lambda: calibration_report(np.empty((0, 3)), np.empty(0, dtype=int)), "empty"),
        (lambda: binary_report([[0.5, 0.5]], [0]), r"\[N\]"),
        (lambda: ece(["a"], [1]), "numeric"),
        (lambda: bootstrap_interval(ece, [0.5, 0.6], [1]), "first dimension"),
        (lambda: bootstrap_interval(ece), "at least one"),
        (lambda: bootstrap_interval(ece, [0.5], [1], confidence=1.5), "confidence"),
        (lambda: bootstrap_interval(ece, [0.5], [1], n_resamples=0), "n_resamples"),
        (lambda: write_reliability_diagram("x.png", {}), "panels"),
        (lambda: write_reliability_diagram("x.png", {"a": [0.5]}), "pair"),
    ],
)
def test_bad_inputs_raise_config_error(call, message):
    with pytest.raises(ConfigError, match=message):
        call()


def test_metrics_import_without_torch_or_matplotlib():
    code = ("import sys; sys.modules['torch'] = None; import calm_runtime.measure.metrics, "
            "calm_runtime.measure.plot; assert 'matplotlib' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_reliability_diagram_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rng = np.random.default_rng(0)
    conf = rng.uniform(size=300)
    panels = {
        "vanilla": (conf, rng.uniform(size=300) < conf**2),
        "calibrated": (conf, rng.uniform(size=300) < conf),
        "edges": (np.array([0.0, 1.0, 1.0]), np.array([0, 1, 0])),
    }
    target = tmp_path / "plots" / "reliability.png"
    written = write_reliability_diagram(target, panels, n_bins=10, title="test")
    assert written == target
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in target.parent.iterdir()] == ["reliability.png"]  # no temp left
    # Overwriting an existing diagram replaces it in place.
    write_reliability_diagram(target, {"one": panels["vanilla"]})
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reliability_diagram_without_matplotlib(tmp_path, monkeypatch):
    # A None entry in sys.modules makes that import fail; block matplotlib and any of its
    # submodules an earlier test may have loaded.
    for name in [m for m in sys.modules if m.split(".")[0] == "matplotlib"] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(BackendUnavailableError, match="calm-llm\\[plot\\]"):
        write_reliability_diagram(tmp_path / "r.png", {"a": ([0.5], [1])})
    assert not list(tmp_path.iterdir())


# --- selective prediction -------------------------------------------------------------------

def test_auroc_matches_scikit_learn_with_ties():
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    from calm_runtime.measure.metrics import auroc

    rng = np.random.default_rng(0)
    for trial in range(20):
        n = int(rng.integers(5, 200))
        conf = np.round(rng.random(n), int(rng.integers(1, 3)))  # coarse: many ties
        correct = (rng.random(n) < conf).astype(float)
        if correct.min() == correct.max():
            continue
        assert auroc(conf, correct) == pytest.approx(
            sklearn_metrics.roc_auc_score(correct, conf), abs=1e-12), trial


def test_auroc_known_cases():
    from calm_runtime.measure.metrics import auroc

    correct = np.array([1, 0, 1, 0, 1.0])
    assert auroc(np.full(5, 0.7), correct) == 0.5
    assert auroc(np.array([0.9, 0.1, 0.8, 0.2, 0.95]), correct) == 1.0
    assert auroc(np.array([0.1, 0.9, 0.2, 0.8, 0.05]), correct) == 0.0
    assert np.isnan(auroc(np.array([0.3, 0.6]), np.array([1.0, 1.0])))


def test_risk_coverage_aurc_and_prr_by_hand():
    from calm_runtime.measure.metrics import aurc, prr, risk_coverage

    conf, correct = np.array([0.9, 0.8, 0.7, 0.6]), np.array([1, 0, 1, 0.0])
    coverage, risk = risk_coverage(conf, correct)
    np.testing.assert_allclose(coverage, [0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(risk, [0, 1 / 2, 1 / 3, 2 / 4])
    assert aurc(conf, correct) == pytest.approx((0 + 1 / 2 + 1 / 3 + 1 / 2) / 4)
    # ties: the first two answers (one wrong) enter together, errors spread over the group
    tied, tied_ok = np.array([0.9, 0.9, 0.5]), np.array([1, 0, 1.0])
    np.testing.assert_allclose(risk_coverage(tied, tied_ok)[1], [0.5, 0.5, 1 / 3])
    assert aurc(tied[::-1], tied_ok[::-1]) == aurc(tied, tied_ok)  # input order is irrelevant
    random_area, oracle_area = 1 / 3, (0 + 0 + 1 / 3) / 3
    assert prr(tied, tied_ok) == pytest.approx(
        (random_area - (0.5 + 0.5 + 1 / 3) / 3) / (random_area - oracle_area))
    assert prr(np.array([0.9, 0.2, 0.8, 0.1]), np.array([1, 0, 1, 0.0])) == pytest.approx(1.0)
    assert prr(np.full(4, 0.6), np.array([1, 0, 1, 0.0])) == pytest.approx(0.0)
    assert np.isnan(prr(np.array([0.2, 0.4]), np.array([1.0, 1.0])))


def test_selective_accuracy_and_report():
    from calm_runtime.measure.metrics import (
        SELECTIVE_THRESHOLDS,
        selective_accuracy,
        selective_report,
    )

    conf = np.array([0.95, 0.9, 0.7, 0.55, 0.4])
    correct = np.array([1, 1, 0, 1, 0.0])
    rows = {r["threshold"]: r for r in selective_accuracy(conf, correct)}
    assert sorted(rows) == list(SELECTIVE_THRESHOLDS)
    assert rows[0.5] == {"threshold": 0.5, "coverage": 0.8, "accuracy": 0.75, "n": 4}
    assert rows[0.9]["accuracy"] == 1.0 and rows[0.9]["n"] == 2  # >= t is kept
    assert rows[0.95]["n"] == 1 and selective_accuracy(conf, correct, [0.99])[0]["n"] == 0
    assert np.isnan(selective_accuracy(conf, correct, [0.99])[0]["accuracy"])
    report = selective_report(conf, correct, bootstrap=50)
    for name in ("auroc", "aurc", "prr"):
        low, high = report[f"{name}_ci"]
        assert low <= high
    assert report["auroc"] == pytest.approx(5 / 6)
