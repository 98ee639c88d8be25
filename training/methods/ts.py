"""The labeled methods (docs/methods.md §3): temperature scaling against the calibration
split's answers (``ts``; on P(True)'s two-way logits, against the answers' correctness) and
vector scaling (``ts-vector``, letter mode). The fits themselves:
:mod:`calm_training.posthoc.daca`."""

from __future__ import annotations

import numpy as np

from calm_training.methods.fit_method import FitMethod, VectorMethod
from calm_training.posthoc import daca

__all__ = ["TS", "TS_VECTOR"]


def _ts_p_true(two_way, correct):
    """Temperature scaling of ``[true, false]`` logits: the label is index 0 when correct."""
    return daca.fit_temperature_scaling(two_way, (1 - np.asarray(correct)).astype(int))


TS = FitMethod("ts", needs_labels=True, token_level=True, p_true=True,
               option_fit=daca.fit_temperature_scaling, p_true_fit=_ts_p_true)
TS_VECTOR = VectorMethod("ts-vector", needs_labels=True, option_fit=daca.fit_vector_scaling)
