"""The labeled temperature scaling (docs/methods.md §3): ``ts``, a temperature against the
calibration split's answers (on P(True)'s two-way logits, against the answers' correctness),
and its token-level counterpart, against the correct answers' tokens.

The option-level fit is :func:`calm_runtime.temperature.fit_temperature_scaling` (an
export's ``--recalibrate`` fits it too, so it sits with the solver every temperature fit
shares); vector scaling with labels (``ts-vector``) is :mod:`calm_training.methods.vector`'s.
"""

from __future__ import annotations

import numpy as np

from calm_runtime.errors import ConfigError
from calm_runtime.temperature import (
    TemperatureFit,
    fit_temperature_scaling,
    solve_inverse_temperature_scores,
    temperature_fit,
)
from calm_training.methods.fit_method import FitMethod

__all__ = ["TS", "fit_token_temperature_scaling"]


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


def _ts_p_true(two_way, correct):
    """Temperature scaling of ``[true, false]`` logits: the label is index 0 when correct."""
    return fit_temperature_scaling(two_way, (1 - np.asarray(correct)).astype(int))


TS = FitMethod("ts", needs_labels=True, p_true=True, option_fit=fit_temperature_scaling,
               p_true_fit=_ts_p_true, token_fit=fit_token_temperature_scaling)
