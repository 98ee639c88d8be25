"""DACA: label-free calibration from a pre-trained model, and its labeled baselines.

docs/methods.md §3. With ``p = softmax(f)`` the PLM's option probabilities and ``g`` the
PoLM's option logits, DACA picks ``T`` minimising the mean ``KL(p || softmax(g / T))``
over the items where both models predict the same option. With ``beta = 1 / T`` the
cross-entropy ``-beta p.g + logsumexp(beta g)`` is convex in ``beta`` and its derivative
``E_softmax(beta g)[g] - p.g`` is monotone, so the scalar fits here are one safeguarded
Newton/bisection root search (:func:`solve_inverse_temperature`): deterministic, tight
tolerance, no learning rate. Temperature scaling with labels is the same search with
one-hot targets. Vector scaling (``w * g + c``) uses the same objectives, fitted with
L-BFGS in torch (imported lazily). Fits return frozen dataclasses; applying them is
``calm_runtime.calibration.apply_calibration`` (the one formula), never re-derived here.
"""

from __future__ import annotations

import logging

import numpy as np

from calm_runtime.errors import ConfigError, FitError
from calm_runtime.temperature import (  # noqa: F401 - the solver's names stay importable from here
    BETA_CAP,
    TOKEN_CHUNK_ROWS,
    TemperatureFit,
    as_labels,
    as_matrix,
    fit_temperature_scaling,
    mean_entropy,
    scalar_fit,
    solve_inverse_temperature,
    solve_inverse_temperature_scores,
    temperature_fit,
)
from calm_training.posthoc._daca_arrays import (  # noqa: F401 - the thresholds stay importable from here
    MIN_AGREEMENT_ITEMS,
    MIN_AGREEMENT_RATE,
    P_TRUE_EPS,
    agreement_set,
    p_true_logits,
)
from calm_training.posthoc.daca_vector import (  # noqa: F401 - vector scaling stays importable from here
    LBFGS_MAX_ITER,
    VectorFit,
    fit_daca_vector_scaling,
    fit_vector_scaling,
    vector_fit_to_tau_shift,
)

__all__ = [
    "TemperatureFit",
    "VectorFit",
    "solve_inverse_temperature",
    "fit_daca_temperature",
    "fit_temperature_scaling",
    "fit_token_daca_temperature",
    "fit_token_temperature_scaling",
    "solve_inverse_temperature_scores",
    "fit_daca_p_true",
    "fit_daca_vector_scaling",
    "fit_vector_scaling",
    "vector_fit_to_tau_shift",
]

logger = logging.getLogger(__name__)



# ------------------------------------------------------------------------- scalar fits


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


def fit_token_temperature_scaling(logits, target_ids) -> TemperatureFit:
    """Token-level temperature scaling with labels (docs/methods.md §3, "Token level"):
    ``T`` minimising the mean NLL of ``target_ids`` under ``softmax(z / T)`` over the full
    vocabulary. ``logits`` ``[P, V]`` are the answer positions' next-token logits,
    ``target_ids`` ``[P]`` the correct answer's tokens."""
    z = np.asarray(logits)
    y = np.asarray(target_ids, dtype=np.int64).reshape(-1)
    if z.ndim != 2 or y.shape[0] != z.shape[0] or ((y < 0) | (y >= z.shape[-1])).any():
        raise ConfigError(f"target_ids must be {z.shape[0] if z.ndim == 2 else '?'} token ids "
                          f"inside the vocabulary of the logits {z.shape}.")
    targets = z[np.arange(z.shape[0]), y].astype(np.float64)
    beta, info = solve_inverse_temperature_scores(z, targets)
    return temperature_fit("ts_token", beta, info, n=z.shape[0], n_used=z.shape[0],
                            agreement_rate=None, target_entropy=0.0)


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


# ------------------------------------------------------------------------- vector scaling
