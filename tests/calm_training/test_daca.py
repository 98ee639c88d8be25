"""Known-answer tests for DACA and its baselines (training/methods/daca.py, ts.py, vector.py;
docs/methods.md §3).

The synthetic data have a known true temperature: PLM logits ``f`` are calibrated by
construction (labels are drawn from ``softmax(f)``), and the PoLM's logits are ``g = k f``
(over-confident, ``k = 2.5``) on agreeing items, so ``softmax(g / k) == softmax(f)``.
"""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

from calm_runtime.calibration import apply_calibration
from calm_runtime.errors import ConfigError, FitError
from calm_runtime.temperature import fit_temperature_scaling, solve_inverse_temperature
from calm_training.methods.daca import fit_daca_p_true, fit_daca_temperature
from calm_training.methods.vector import (
    VectorFit,
    fit_daca_vector_scaling,
    fit_vector_scaling,
    vector_fit_to_tau_shift,
)

N, K, TRUE_T = 4000, 4, 2.5


def _softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _sample_labels(probs, rng):
    u = rng.random((probs.shape[0], 1))
    return np.minimum((probs.cumsum(axis=1) < u).sum(axis=1), probs.shape[1] - 1)


def _synthetic(seed=0, noise_fraction=0.3):
    """PLM ``f`` (calibrated), labels ``y ~ softmax(f)``, PoLM ``g = k f`` with a fraction
    of rows made to disagree (the PLM's top option swapped with another one)."""
    rng = np.random.default_rng(seed)
    f = rng.normal(0.0, 1.5, size=(N, K))
    y = _sample_labels(_softmax(f), rng)
    g_clean = TRUE_T * f
    g = g_clean.copy()
    for i in np.flatnonzero(rng.random(N) < noise_fraction):
        top = int(f[i].argmax())
        other = (top + 1 + int(rng.integers(K - 1))) % K
        g[i, [top, other]] = g[i, [other, top]]
    return f, g, g_clean, y


def _cross_entropy(beta, g, p):
    """Mean -sum p log softmax(beta g), written independently of the module."""
    z = beta * g
    m = z.max(axis=1, keepdims=True)
    log_q = z - m - np.log(np.exp(z - m).sum(axis=1, keepdims=True))
    return float(-(p * log_q).sum(axis=1).mean())


def test_daca_recovers_known_temperature():
    f, g, _, _ = _synthetic()
    fit = fit_daca_temperature(f, g)
    assert fit.method == "daca" and fit.at_bound is None
    assert abs(fit.temperature - TRUE_T) / TRUE_T < 0.02, fit
    assert abs(fit.beta - 1.0 / TRUE_T) * TRUE_T < 0.02, fit
    agree = f.argmax(1) == g.argmax(1)
    assert fit.n == N and fit.n_used == int(agree.sum())
    assert fit.agreement_rate == pytest.approx(agree.mean())
    assert 0.6 < fit.agreement_rate < 0.8
    assert abs(fit.objective) < 1e-9  # the KL is 0 at the true temperature
    assert fit.iterations < 100
    # The fitted T, applied through the one calibration formula, reproduces the PLM.
    calibrated = _softmax(apply_calibration(g[agree], temperature=fit.temperature))
    np.testing.assert_allclose(calibrated, _softmax(f[agree]), atol=1e-9)


def test_daca_with_noisy_polm_is_the_grid_minimum():
    f, g, _, _ = _synthetic(seed=3)
    g = g + np.random.default_rng(4).normal(0.0, 0.3, size=g.shape)
    fit = fit_daca_temperature(f, g)
    assert abs(fit.temperature - TRUE_T) / TRUE_T < 0.05, fit
    agree = f.argmax(1) == g.argmax(1)
    p, ga = _softmax(f[agree]), g[agree]
    betas = np.linspace(0.5 * fit.beta, 1.5 * fit.beta, 2001)
    grid = [_cross_entropy(b, ga, p) for b in betas]
    best = _cross_entropy(fit.beta, ga, p)
    assert best <= min(grid) + 1e-12
    entropy = float(-(p * np.log(p)).sum(axis=1).mean())
    assert fit.objective == pytest.approx(best - entropy, abs=1e-12)


def test_naive_alignment_overestimates_temperature():
    f, g, _, _ = _synthetic()
    daca = fit_daca_temperature(f, g)
    naive = fit_daca_temperature(f, g, mask=False)
    assert naive.method == "naive" and naive.n_used == N
    assert naive.agreement_rate == daca.agreement_rate
    assert naive.temperature > 1.5 * daca.temperature, (naive, daca)


def test_labeled_temperature_scaling_recovers_temperature():
    _, _, g_clean, y = _synthetic()
    fit = fit_temperature_scaling(g_clean, y)
    assert fit.method == "ts" and fit.agreement_rate is None and fit.at_bound is None
    assert abs(fit.temperature - TRUE_T) / TRUE_T < 0.05, fit
    assert fit.iterations < 100
    assert fit.objective == pytest.approx(
        -np.log(_softmax(g_clean / fit.temperature)[np.arange(N), y]).mean(), abs=1e-12)


def test_solver_is_deterministic_and_takes_few_iterations():
    f, g, _, _ = _synthetic(seed=5)
    g = g + np.random.default_rng(6).normal(0.0, 0.2, size=g.shape)
    p = _softmax(f)
    beta1, info1 = solve_inverse_temperature(g, p)
    beta2, info2 = solve_inverse_temperature(g, p)
    assert beta1 == beta2 and info1 == info2
    assert info1["converged"] and info1["iterations"] < 100
    assert abs(info1["derivative"]) < 1e-8
    # Scale-free: rescaling the logits rescales beta exactly (up to rounding).
    beta3, _ = solve_inverse_temperature(1000.0 * g, p)
    assert beta3 * 1000.0 == pytest.approx(beta1, rel=1e-10)


def test_empty_agreement_raises():
    f, _, _, _ = _synthetic()
    shuffled = np.roll(f, 1, axis=1)
    order = shuffled.argmax(1) == f.argmax(1)
    shuffled[order] = -f[order]  # make every row disagree
    assert not (shuffled.argmax(1) == f.argmax(1)).any()
    with pytest.raises(FitError, match="agree on none"):
        fit_daca_temperature(f, shuffled)


def test_tiny_agreement_warns_and_still_fits(caplog):
    f, g, _, _ = _synthetic()
    keep = np.flatnonzero(f.argmax(1) == g.argmax(1))[:10]
    disagree = np.flatnonzero(f.argmax(1) != g.argmax(1))[:500]
    rows = np.concatenate([keep, disagree])
    with caplog.at_level(logging.WARNING, logger="calm_training.methods.daca"):
        fit = fit_daca_temperature(f[rows], g[rows])
    assert fit.n_used == 10 and fit.n == 510
    assert "10 of 510" in caplog.text
    assert abs(fit.temperature - TRUE_T) / TRUE_T < 0.02


def test_anti_correlated_polm_is_at_infinite_temperature():
    f, _, _, _ = _synthetic()
    fit = fit_daca_temperature(f, -f, mask=False)  # derivative >= 0 at beta = 0
    assert fit.at_bound == "infinite_temperature"
    assert fit.beta == 0.0 and math.isinf(fit.temperature)
    assert fit.objective > 0.0
    assert json.loads(json.dumps(fit.to_dict()))["temperature"] is None
    # Agreeing on the top option but reversed on the rest (METHODS §3, Prop. 3.3 shape).
    plm = np.array([[1.0, 0.99, -10.0]] * 30)
    polm = np.array([[1.0, -10.0, 0.9]] * 30)
    daca = fit_daca_temperature(plm, polm)
    assert daca.n_used == 30 and daca.at_bound == "infinite_temperature"


def test_always_right_labels_are_at_zero_temperature():
    _, _, g_clean, _ = _synthetic()
    fit = fit_temperature_scaling(g_clean, g_clean.argmax(1))
    assert fit.at_bound == "zero_temperature"
    assert 0.0 < fit.temperature < 1e-5


def test_models_need_only_same_items_and_options():
    f, g, _, _ = _synthetic()
    with pytest.raises(ConfigError, match="same K"):
        fit_daca_temperature(f, g[:, :3])
    with pytest.raises(ConfigError, match="non-finite"):
        fit_daca_temperature(f, np.where(g > 5, np.nan, g))
    with pytest.raises(ConfigError, match="labels"):
        fit_temperature_scaling(g, np.full(N, K))


def test_daca_p_true_recovers_two_way_temperature():
    rng = np.random.default_rng(7)
    k = 2.0
    p_plm = rng.uniform(0.02, 0.98, N)
    logit = np.log(p_plm) - np.log1p(-p_plm)
    p_polm = 1.0 / (1.0 + np.exp(-k * logit))  # over-confident by a factor k
    flip = rng.random(N) < 0.2
    p_polm[flip] = 1.0 - p_polm[flip]
    fit = fit_daca_p_true(p_plm, p_polm)
    assert fit.method == "daca_p_true" and fit.n_used == int((~flip).sum())
    assert abs(fit.temperature - k) / k < 0.02, fit
    naive = fit_daca_p_true(p_plm, p_polm, mask=False)
    assert naive.temperature > 1.5 * fit.temperature


W_TRUE = np.array([0.6, 1.0, 1.5, 0.8])
C_TRUE = np.array([0.3, -0.2, 0.5, -0.6])


def test_daca_vector_scaling_recovers_weights_and_bias():
    rng = np.random.default_rng(1)
    g = rng.normal(0.0, 2.0, size=(N, K))
    f = W_TRUE * g + C_TRUE
    fit = fit_daca_vector_scaling(f, g)
    assert fit.method == "daca_vector" and fit.converged and fit.iterations < 200
    assert fit.n_used == int((f.argmax(1) == g.argmax(1)).sum()) < N
    np.testing.assert_allclose(fit.weights, W_TRUE, rtol=0.02)
    np.testing.assert_allclose(fit.bias, C_TRUE - C_TRUE.mean(), atol=0.02)
    probs = _softmax(np.asarray(fit.weights) * g + np.asarray(fit.bias))
    assert np.abs(probs - _softmax(f)).max() < 1e-3
    assert fit == fit_daca_vector_scaling(f, g)  # deterministic
    json.dumps(fit.to_dict())


def test_labeled_vector_scaling_reduces_nll():
    rng = np.random.default_rng(2)
    g = rng.normal(0.0, 2.0, size=(N, K))
    y = _sample_labels(_softmax(W_TRUE * g + C_TRUE), rng)
    fit = fit_vector_scaling(g, y)
    assert fit.method == "vector" and fit.converged and fit.agreement_rate is None
    nll_identity = -np.log(_softmax(g)[np.arange(N), y]).mean()
    nll_fit = -np.log(_softmax(np.asarray(fit.weights) * g + fit.bias)[np.arange(N), y]).mean()
    assert fit.objective == pytest.approx(nll_fit, abs=1e-9)
    assert fit.objective < nll_identity - 0.05
    np.testing.assert_allclose(fit.weights, W_TRUE, rtol=0.1)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_vector_fit_maps_exactly_onto_option_tokens(temperature):
    rng = np.random.default_rng(8)
    vocab, ids = 50, np.array([7, 3, 20, 41])
    z = rng.normal(0.0, 3.0, size=(64, vocab)).astype(np.float32)
    fit = VectorFit(method="vector", weights=tuple(W_TRUE), bias=tuple(C_TRUE), n=64,
                    n_used=64, agreement_rate=None, objective=0.0, converged=True, iterations=0)
    tau, shift = vector_fit_to_tau_shift(fit, ids, vocab, temperature=temperature)
    assert tau.dtype == shift.dtype == np.float32 and tau.shape == shift.shape == (vocab,)
    others = np.setdiff1d(np.arange(vocab), ids)
    assert (tau[others] == 1).all() and (shift[others] == 0).all()
    calibrated = apply_calibration(z, tau, shift, temperature=temperature)
    restricted = _softmax(calibrated[:, ids].astype(np.float64))
    expected = _softmax(W_TRUE * z[:, ids].astype(np.float64) + C_TRUE)
    assert np.abs(restricted - expected).max() < 1e-5


def test_vector_fit_mapping_rejects_unrepresentable_fits():
    def fit_with(weights):
        return VectorFit(method="vector", weights=tuple(weights), bias=(0.0,) * 3, n=1,
                         n_used=1, agreement_rate=None, objective=0.0, converged=True,
                         iterations=0)

    with pytest.raises(ConfigError, match="cannot be represented"):
        vector_fit_to_tau_shift(fit_with([1.0, -0.5, 1.0]), [1, 2, 3], 10)
    with pytest.raises(ConfigError, match="duplicates"):
        vector_fit_to_tau_shift(fit_with([1.0, 1.0, 1.0]), [1, 2, 2], 10)
    with pytest.raises(ConfigError, match=r"\[0, 10\)"):
        vector_fit_to_tau_shift(fit_with([1.0, 1.0, 1.0]), [1, 2, 10], 10)
    with pytest.raises(ConfigError, match="3 integer token ids"):
        vector_fit_to_tau_shift(fit_with([1.0, 1.0, 1.0]), [1, 2], 10)
