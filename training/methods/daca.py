"""The label-free methods (docs/methods.md §3): a temperature that aligns the model's
option (or P(True)) distributions with a pre-trained reference model's, on the questions
where both choose the same answer (``daca``) or on every question (``naive``, the baseline
DACA improves on), their fits, and the agreement set DACA's vector scaling
(``daca-vector``, :mod:`calm_training.methods.vector`) fits on too.

With ``p = softmax(f)`` the PLM's option probabilities and ``g`` the PoLM's option logits,
DACA picks ``T`` minimising the mean ``KL(p || softmax(g / T))`` over the items where both
models predict the same option. With ``beta = 1 / T`` the cross-entropy ``-beta p.g +
logsumexp(beta g)`` is convex in ``beta`` and its derivative ``E_softmax(beta g)[g] - p.g`` is
monotone, so each fit here is one safeguarded Newton/bisection root search
(:func:`calm_runtime.temperature.solve_inverse_temperature`, the solver every temperature
fit shares): deterministic, tight tolerance, no learning rate. Fits return frozen
dataclasses; applying them is ``calm_runtime.calibration.apply_calibration`` (the one
formula), never re-derived here.
"""

from __future__ import annotations

import logging
from functools import partial

import numpy as np

from calm_runtime.errors import ConfigError, FitError
from calm_runtime.modes import option_probabilities
from calm_runtime.temperature import (
    TOKEN_CHUNK_ROWS,
    TemperatureFit,
    as_matrix,
    scalar_fit,
    solve_inverse_temperature_scores,
    temperature_fit,
)
from calm_training.methods.fit_method import FitMethod

__all__ = ["DACA", "MIN_AGREEMENT_ITEMS", "MIN_AGREEMENT_RATE", "NAIVE", "P_TRUE_EPS",
           "agreement_set", "fit_daca_p_true", "fit_daca_temperature",
           "fit_token_daca_temperature", "p_true_logits"]

logger = logging.getLogger(__name__)

#: agreement sets already warned about as tiny (one warning each, not one per fit)
_WARNED: set[tuple[int, bytes]] = set()

# The agreement set is "tiny" (warn, still fit) below either threshold.
MIN_AGREEMENT_ITEMS = 20
MIN_AGREEMENT_RATE = 0.05
P_TRUE_EPS = 1e-6  # P(True) is clipped to [eps, 1 - eps] before taking logs.


def agreement_set(plm_logits, polm_logits, mask, min_agreement, min_agreement_rate):
    """``(p, g, n, agreement_rate)`` with ``p = softmax(f)`` and ``g`` restricted to the
    agreeing items when ``mask``; raises on an empty set, warns on a tiny one."""
    f = as_matrix(plm_logits, "plm_logits")
    g = as_matrix(polm_logits, "polm_logits")
    if f.shape != g.shape:
        raise ConfigError(f"PLM option logits have shape {f.shape} but PoLM {g.shape}; both "
                          "need one row per item and the same K options.")
    agree = f.argmax(axis=1) == g.argmax(axis=1)
    n, n_agree = f.shape[0], int(agree.sum())
    rate = n_agree / n if n else 0.0
    p = option_probabilities(f)
    if not mask:
        return p, g, n, rate
    if n_agree == 0:
        raise FitError(f"the PLM and PoLM agree on none of the {n} items, so DACA has no "
                       "items to fit on; check that both use the same option order.")
    if n_agree < min_agreement or rate < min_agreement_rate:
        key = (n, np.packbits(agree).tobytes())
        if key not in _WARNED:  # once per agreement set (DACA and its vector variant share it)
            _WARNED.add(key)
            logger.warning("DACA agreement set is tiny: %d of %d items (%.1f%%); the fit is "
                           "poorly determined.", n_agree, n, 100 * rate)
    return p[agree], g[agree], n, rate


def p_true_logits(x, name: str) -> np.ndarray:
    """P(True) probabilities ``x`` ``[N]`` as two-way ``[log p, log(1 - p)]`` logits, ``p``
    clipped to ``[P_TRUE_EPS, 1 - P_TRUE_EPS]``."""
    p = np.asarray(x, dtype=np.float64)
    if p.ndim != 1 or not np.isfinite(p).all() or (p < 0).any() or (p > 1).any():
        raise ConfigError(f"{name} must be a 1-D array of probabilities in [0, 1], got shape "
                          f"{p.shape}.")
    p = np.clip(p, P_TRUE_EPS, 1.0 - P_TRUE_EPS)
    return np.stack([np.log(p), np.log1p(-p)], axis=1)


def fit_daca_temperature(plm_logits, polm_logits, *, mask: bool = True,
                         min_agreement: int = MIN_AGREEMENT_ITEMS,
                         min_agreement_rate: float = MIN_AGREEMENT_RATE) -> TemperatureFit:
    """DACA temperature for the PoLM from the PLM's option logits (both ``[N, K]``).

    The two models may use different tokenizers; only ``N`` and ``K`` must match (each
    model's own option-token logits). ``mask=False`` is the "naive alignment" baseline
    (every item used; METHODS §3 says it is pushed toward ``T -> inf``). An empty agreement
    set raises :class:`FitError`; fewer than ``min_agreement`` agreeing items or an
    agreement rate below ``min_agreement_rate`` logs a warning and still fits.
    """
    p, g, n, rate = agreement_set(plm_logits, polm_logits, mask, min_agreement,
                                  min_agreement_rate)
    return scalar_fit("daca" if mask else "naive", g, p, n=n, agreement_rate=rate)


def fit_daca_p_true(plm_p_true, polm_p_true, *, mask: bool = True,
                    min_agreement: int = MIN_AGREEMENT_ITEMS,
                    min_agreement_rate: float = MIN_AGREEMENT_RATE) -> TemperatureFit:
    """DACA on two-way P(True) distributions (open QA, METHODS §3 "Extensions").

    Each probability ``p`` (clipped to ``[P_TRUE_EPS, 1 - P_TRUE_EPS]``) becomes the two-way
    logits ``[log p, log(1 - p)]``; the fitted ``T`` applies to the PoLM's two-way logits.
    """
    p, g, n, rate = agreement_set(p_true_logits(plm_p_true, "plm_p_true"),
                                  p_true_logits(polm_p_true, "polm_p_true"), mask,
                                  min_agreement, min_agreement_rate)
    method = "daca_p_true" if mask else "naive_p_true"
    return scalar_fit(method, g, p, n=n, agreement_rate=rate)


def fit_token_daca_temperature(model_logits, reference_logits, *, n_questions: int | None = None,
                               mask: bool = True, min_agreement: int = MIN_AGREEMENT_ITEMS,
                               min_agreement_rate: float = MIN_AGREEMENT_RATE) -> TemperatureFit:
    """Label-free token-level DACA (docs/methods.md §3, "Token level"): ``T`` minimising the
    mean ``KL(p_ref || softmax(z / T))`` over the positions where the reference's and the
    model's next-token argmax agree. Both ``[P, V]`` over one vocabulary (the reference must
    share the model's tokenizer); rows are the answer positions already chosen (agreeing
    questions, teacher-forced on the model's answer). ``n`` of the fit is ``n_questions``
    when given (else the position count); ``agreement_rate`` is the share of positions kept."""
    z = np.asarray(model_logits)
    r = np.asarray(reference_logits)
    if z.ndim != 2 or z.shape != r.shape:
        raise ConfigError(f"model logits {z.shape} and reference logits {r.shape} must both be "
                          "[positions, vocabulary] over the same vocabulary; a token-level fit "
                          "needs a reference with the model's tokenizer")
    if z.shape[0] == 0:
        raise FitError("no answer positions to fit a token-level temperature on")
    dots = np.empty(z.shape[0])
    entropy = np.empty(z.shape[0])
    agree = np.empty(z.shape[0], dtype=bool)
    for start in range(0, z.shape[0], TOKEN_CHUNK_ROWS):
        rows = slice(start, start + TOKEN_CHUNK_ROWS)
        ref = np.asarray(r[rows], dtype=np.float64)
        ref = ref - ref.max(axis=1, keepdims=True)
        logp = ref - np.log(np.exp(ref).sum(axis=1, keepdims=True))
        p = np.exp(logp)
        dots[rows] = np.einsum("nv,nv->n", p, np.asarray(z[rows], dtype=np.float64))
        entropy[rows] = -np.einsum("nv,nv->n", p, logp)
        agree[rows] = r[rows].argmax(axis=1) == z[rows].argmax(axis=1)
    used = int(agree.sum())
    rate = used / z.shape[0]
    if used == 0 and mask:
        raise FitError(f"the model and the reference agree on the next token at none of the "
                       f"{z.shape[0]} answer positions; no token-level DACA temperature is "
                       "identifiable")
    if mask and (used < min_agreement or rate < min_agreement_rate):
        logger.warning("token-level DACA: only %d of %d answer positions agree (%.1f%%); the "
                       "temperature is fitted on few items", used, z.shape[0], 100 * rate)
    keep = np.flatnonzero(agree) if mask else np.arange(z.shape[0])
    beta, info = solve_inverse_temperature_scores(z[keep], dots[keep])
    return temperature_fit("daca_token" if mask else "naive_token", beta, info,
                            n=z.shape[0] if n_questions is None else n_questions,
                            n_used=keep.size, agreement_rate=rate,
                            target_entropy=float(entropy[keep].mean()))


NAIVE = FitMethod("naive", needs_reference=True, p_true=True,
                  option_fit=partial(fit_daca_temperature, mask=False),
                  p_true_fit=partial(fit_daca_p_true, mask=False),
                  token_fit=partial(fit_token_daca_temperature, mask=False))
DACA = FitMethod("daca", needs_reference=True, masked=True, p_true=True,
                 option_fit=partial(fit_daca_temperature, mask=True),
                 p_true_fit=partial(fit_daca_p_true, mask=True),
                 token_fit=partial(fit_token_daca_temperature, mask=True))
