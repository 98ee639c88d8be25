"""The arrays DACA's fits share: input checks, the agreement set (the items where the model
and the reference pick the same option) and mean entropy (docs/methods.md §3)."""

from __future__ import annotations

import logging

import numpy as np

from calm_runtime.errors import ConfigError, FitError
from calm_runtime.modes import option_probabilities
from calm_runtime.temperature import (  # noqa: F401 - the array checks stay importable from here
    as_labels,
    as_matrix,
    mean_entropy,
)

logger = logging.getLogger("calm_training.posthoc.daca")

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
        logger.warning("DACA agreement set is tiny: %d of %d items (%.1f%%); the fit is "
                       "poorly determined.", n_agree, n, 100 * rate)
    return p[agree], g[agree], n, rate


def p_true_logits(x, name: str) -> np.ndarray:
    p = np.asarray(x, dtype=np.float64)
    if p.ndim != 1 or not np.isfinite(p).all() or (p < 0).any() or (p > 1).any():
        raise ConfigError(f"{name} must be a 1-D array of probabilities in [0, 1], got shape "
                          f"{p.shape}.")
    p = np.clip(p, P_TRUE_EPS, 1.0 - P_TRUE_EPS)
    return np.stack([np.log(p), np.log1p(-p)], axis=1)
