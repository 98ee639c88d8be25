"""The do-no-harm gate's rule (calm_training.methods.calm.gate): a paired Student-t interval on the
NLL change, a paired interval on the accuracy change, fixed halves of the hold-out."""

from __future__ import annotations

import numpy as np
import pytest

from calm_training.methods.calm.gate import (
    ACCURACY_MARGIN,
    MIN_DECIDING,
    decide_part,
    gate_halves,
    paired_interval,
    t_quantile,
)


@pytest.mark.parametrize(("df", "expected"), [(1, 12.7062), (2, 4.3027), (5, 2.5706),
                                              (29, 2.0452), (99, 1.9842), (1000, 1.9623)])
def test_t_quantiles_are_students(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-4)


def test_the_interval_uses_t_not_z():
    diff = np.array([-1.0, 0.0] * 15)  # n = 30
    mean, half = paired_interval(diff)
    assert mean == pytest.approx(-0.5)
    assert half == pytest.approx(2.0452 * diff.std(ddof=1) / np.sqrt(30), rel=1e-4)
    assert paired_interval([0.3])[1] is None and paired_interval([1.0, np.inf])[1] is None


def test_a_gain_within_its_interval_is_dropped_and_one_beyond_it_kept():
    rng = np.random.default_rng(0)
    without = rng.uniform(0.5, 1.5, 300)
    noisy = without + rng.normal(-0.01, 0.5, 300)  # a small gain, widely spread
    decision = decide_part("T", noisy, without)
    assert not decision["kept"] and "within the paired 95% interval" in decision["reason"]
    clear = without - 0.05 + rng.normal(0, 0.01, 300)
    decision = decide_part("T", clear, without)
    assert decision["kept"] and decision["reason"].startswith("T kept")
    assert not decision["weak"]


def test_the_accuracy_check_is_an_interval_against_the_margin():
    n = 400
    without = np.full(n, 1.0)
    better = without - 0.2
    right = np.ones(n)
    # 8 of 400 answers lost (-0.02): NLL better, but the interval reaches below -0.03
    lost = right.copy()
    lost[:8] = 0
    decision = decide_part("alpha", better, without, lost, right)
    lo, hi = decision["accuracy_change_interval"]
    assert lo < -ACCURACY_MARGIN < decision["accuracy_change"] < hi
    assert not decision["kept"] and "accuracy change" in decision["reason"]
    # one answer lost of 400: kept
    lost = right.copy()
    lost[0] = 0
    assert decide_part("alpha", better, without, lost, right)["kept"]
    # a temperature changes no answer: its accuracy interval is [0, 0]
    decision = decide_part("T", better, without, right, right)
    assert decision["accuracy_change_interval"] == [0.0, 0.0] and decision["kept"]


def test_a_small_gate_says_it_is_weak():
    decision = decide_part("alpha", np.full(30, 0.5) - np.linspace(0, 0.1, 30), np.full(30, 0.6))
    assert decision["weak"] and f"fewer than {MIN_DECIDING}" in decision["reason"]


def test_halves_are_fixed_disjoint_and_cover_the_hold_out():
    deciding, reporting = gate_halves(75)
    again = gate_halves(75)
    assert np.array_equal(deciding, again[0]) and np.array_equal(reporting, again[1])
    assert deciding.size == 38 and reporting.size == 37
    assert sorted([*deciding, *reporting]) == list(range(75))
    assert not np.array_equal(deciding, np.arange(38))  # a permutation, not the file order


def test_alpha_is_decided_by_non_inferiority():
    """α's claim is out of domain: in domain it is kept when its NLL change's interval stays
    below the margin (no gain needed), dropped when it reaches above it or costs accuracy."""
    from calm_training.methods.calm.gate import NLL_MARGIN

    rng = np.random.default_rng(4)
    without = rng.uniform(0.5, 1.5, 300)
    same = without + rng.normal(0, 0.01, 300)  # no gain, no harm
    assert not decide_part("alpha", same, without)["kept"]  # superiority: no gain, dropped
    kept = decide_part("alpha", same, without, rule="non-inferiority")
    assert kept["kept"] and "not worse in domain" in kept["reason"]
    worse = without + NLL_MARGIN + rng.normal(0, 0.01, 300)
    dropped = decide_part("alpha", worse, without, rule="non-inferiority")
    assert not dropped["kept"] and f"reaches above +{NLL_MARGIN:g}" in dropped["reason"]
    right = np.ones(300)
    lost = right.copy()
    lost[:30] = 0  # 10 points of accuracy
    assert not decide_part("alpha", same, without, lost, right,
                           rule="non-inferiority")["kept"]
