"""Token statistics and sampling rules (numpy only) against brute-force definitions."""

from __future__ import annotations

import numpy as np
import pytest

from calm_runtime.errors import ConfigError
from calm_runtime.inference.sampling import (
    SamplingParams,
    _candidates,
    choose_tokens,
    row_generators,
    step_stats,
    top_alternatives,
)


def _logits(seed=0, rows=3, vocab=500, scale=3.0):
    return (np.random.default_rng(seed).normal(size=(rows, vocab)) * scale).astype(np.float32)


def test_step_stats_equal_the_definitions():
    z = _logits()
    stats = step_stats(z)
    p = np.exp(z.astype(np.float64) - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    rows, tokens = np.arange(3), np.array([0, 17, 499])
    np.testing.assert_allclose(stats.probability(rows, tokens), p[rows, tokens], rtol=1e-5)
    np.testing.assert_allclose(stats.logprob(rows, tokens), np.log(p[rows, tokens]), atol=1e-5)
    np.testing.assert_allclose(stats.entropy, -(p * np.log(p)).sum(axis=1), atol=1e-5)
    for k in (1, 4, 500):
        ids, probs = top_alternatives(stats, 1, k)
        np.testing.assert_array_equal(ids, np.argsort(-p[1], kind="stable")[:k])
        np.testing.assert_allclose(probs, np.sort(p[1])[::-1][:k], rtol=1e-5)
    ties = step_stats(np.array([[2.0, 5.0, 2.0, 5.0, 1.0]], np.float32))
    assert top_alternatives(ties, 0, 3)[0].tolist() == [1, 3, 0]


def test_a_peaked_distribution_has_zero_entropy_and_full_confidence():
    z = np.array([[0.0, 1e4, 0.0]], np.float32)
    stats = step_stats(z)
    assert stats.entropy[0] == pytest.approx(0.0, abs=1e-12)
    assert stats.probability(np.array([0]), np.array([1]))[0] == 1.0


def _brute_force(weights, top_k, top_p):
    order = np.lexsort((np.arange(weights.size), -weights))
    if top_k:
        order = order[:top_k]
    mass = weights[order]
    before = np.cumsum(mass, dtype=np.float64) - mass
    keep = max(1, int(np.count_nonzero(before < top_p * mass.sum(dtype=np.float64))))
    return np.sort(order[:keep])


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.3), (0, 0.9), (0, 0.999), (10, 1.0),
                                              (10, 0.5), (200, 0.95), (1, 0.9)])
def test_candidates_equal_a_full_sort(top_k, top_p):
    for seed in range(8):
        vocab = 60_000 if seed >= 6 else 1000  # large flat bands take the histogram path
        z = _logits(seed, rows=1, vocab=vocab, scale=(0.3, 2.0, 8.0)[seed % 3])[0]
        if seed == 5:
            z = np.round(z)  # many exact ties
        scaled = z - z.max()
        weights = np.exp(scaled)
        got = np.sort(_candidates(scaled, weights, top_k, top_p))
        np.testing.assert_array_equal(got, _brute_force(weights, top_k, top_p))


def test_greedy_takes_the_lowest_id_on_ties_and_ignores_generators():
    z = np.array([[1.0, 3.0, 3.0, 0.0]], np.float32)
    assert choose_tokens(step_stats(z), SamplingParams(), []).tolist() == [1]


def test_sampling_is_seeded_per_row_and_follows_the_distribution():
    z = np.log(np.array([[0.5, 0.3, 0.2, 0.0]], np.float32) + 1e-30)
    stats = step_stats(z)
    params = SamplingParams(temperature=1.0, seed=0)
    gen = row_generators(0, 1)[0]
    draws = np.array([choose_tokens(stats, params, [gen])[0] for _ in range(4000)])
    assert 3 not in draws  # zero probability is never drawn
    np.testing.assert_allclose(np.bincount(draws, minlength=4)[:3] / 4000, [0.5, 0.3, 0.2],
                               atol=0.03)
    # row i draws the same numbers whatever the batch size
    assert row_generators(5, 3)[1].random() == row_generators(5, 2)[1].random()
    assert row_generators(5, 1)[0].random() != row_generators(6, 1)[0].random()


@pytest.mark.parametrize("bad", [{"temperature": -0.1}, {"temperature": float("nan")},
                                 {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5},
                                 {"seed": -3}, {"temperature": True}])
def test_bad_sampling_settings_are_one_config_error(bad):
    with pytest.raises(ConfigError) as info:
        SamplingParams(**bad)
    assert "\n" not in str(info.value) and str(info.value).startswith("invalid sampling")


def test_blockwise_inverse_cdf_equals_a_global_cumsum():
    from calm_runtime.inference.sampling import _inverse_cdf

    rng = np.random.default_rng(1)
    for n in (7, 4096, 10_000, 50_001):
        weights = rng.exponential(size=n).astype(np.float32)
        weights[rng.random(n) < 0.3] = 0.0
        cumulative = np.cumsum(weights, dtype=np.float64)
        for u in np.concatenate([rng.random(300), [0.0, 1.0 - 1e-12]]):
            want = min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")), n - 1)
            assert _inverse_cdf(weights, float(u)) == want
            assert weights[want] > 0
