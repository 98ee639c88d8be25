"""Proposition 3.3 of the DACA paper on synthetic scores (docs/methods.md §3, no model).

On a disagreement where the reference (PLM) gives the PoLM's answer less than ``1/K``,
the KL to the reference is minimised by the uniform distribution's side of the
temperature axis: the naive objective's derivative in ``beta = 1/T`` at ``beta = 0`` is
``E_uniform[g] - p.g``, positive for one-hot-like PoLM logits when ``p_answer < 1/K``. So
naive alignment (every item) is pulled toward ``T -> inf`` as such disagreements become a
larger share of the fitting set, while DACA (the agreement mask) drops them and keeps its
temperature. ``benchmarks/daca_regime.py`` measures how large that share is on real models.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from calm_training.methods.daca import fit_daca_temperature

K = 4
N_AGREE = 200
TRUE_T = 2.5
SHARES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def _agreeing(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` items on which both models pick the same option: the PoLM's logits are the
    reference's times ``TRUE_T`` (over-confident), so DACA's answer is ``TRUE_T``."""
    f = rng.normal(0.0, 1.5, size=(n, K))
    return f, TRUE_T * f


def _low_disagreements(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` disagreements in Prop. 3.3's case: the PoLM is confident in an option to which
    the reference gives less than ``1/K``."""
    answer = rng.integers(0, K, size=n)
    g = rng.normal(0.0, 0.3, size=(n, K))
    g[np.arange(n), answer] += 6.0
    f = rng.normal(0.0, 0.3, size=(n, K))
    f[np.arange(n), (answer + 1 + rng.integers(0, K - 1, size=n)) % K] += 2.0
    f[np.arange(n), answer] -= 1.0
    return f, g


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _sweep():
    rng = np.random.default_rng(0)
    f_agree, g_agree = _agreeing(rng, N_AGREE)
    f_dis, g_dis = _low_disagreements(rng, 10 * N_AGREE)
    # the construction is the proposition's case, or the test proves nothing
    assert (f_agree.argmax(1) == g_agree.argmax(1)).all()
    assert (f_dis.argmax(1) != g_dis.argmax(1)).all()
    assert (_softmax(f_dis)[np.arange(len(g_dis)), g_dis.argmax(1)] < 1.0 / K).all()
    naive, daca = [], []
    for share in SHARES:
        n_dis = round(N_AGREE * share / (1.0 - share))
        f = np.concatenate([f_agree, f_dis[:n_dis]])
        g = np.concatenate([g_agree, g_dis[:n_dis]])
        naive.append(fit_daca_temperature(f, g, mask=False))
        daca.append(fit_daca_temperature(f, g, mask=True))
        assert daca[-1].agreement_rate == pytest.approx(1.0 - share, abs=0.01)
    return naive, daca


def test_naive_temperature_grows_without_bound_with_the_share_of_low_disagreements():
    naive, _ = _sweep()
    temps = [fit.temperature for fit in naive]
    assert temps[0] == pytest.approx(TRUE_T, rel=1e-6)  # no disagreement: naive == DACA
    finite = [t for t in temps if math.isfinite(t)]
    # strictly increasing while finite, and once infinite it stays infinite
    assert (np.diff(finite) > 0).all(), temps
    assert temps[: len(finite)] == finite, temps
    assert temps[-1] > 100 * TRUE_T, temps  # "exceeds a large value" (here: inf)
    assert not math.isfinite(temps[-1]) and naive[-1].at_bound == "infinite_temperature"


def test_masked_daca_temperature_does_not_move():
    _, daca = _sweep()
    for fit in daca:
        assert fit.n_used == N_AGREE
        assert fit.temperature == pytest.approx(TRUE_T, rel=1e-6), fit
        assert fit.at_bound is None


@pytest.mark.parametrize("p_answer, infinite", [(0.10, True), (0.20, True), (0.30, False),
                                                (0.60, False)])
def test_single_disagreement_is_infinite_exactly_below_one_over_k(p_answer, infinite):
    """The proposition itself: one item, one-hot PoLM logits on option 0; the reference
    gives option 0 probability ``p_answer`` (another option its argmax when below 1/K)."""
    rest = (1.0 - p_answer) / (K - 1)
    p = np.full(K, rest)
    p[0] = p_answer
    if p_answer < 1.0 / K:  # make it a genuine disagreement: another option on top
        p[1:] = np.array([0.5, 0.3, 0.2]) * (1.0 - p_answer)
    g = np.zeros((1, K))
    g[0, 0] = 5.0
    fit = fit_daca_temperature(np.log(p)[None, :], g, mask=False)
    assert math.isinf(fit.temperature) is infinite, fit
