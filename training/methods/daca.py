"""The label-free methods (docs/methods.md §3): a temperature that aligns the model's
option (or P(True)) distributions with a pre-trained reference model's, on the questions
where both choose the same answer (``daca``) or on every question (``naive``, the baseline
DACA improves on), and DACA's vector scaling (``daca-vector``, letter mode). The fits
themselves: :mod:`calm_training.posthoc.daca`."""

from __future__ import annotations

from functools import partial

from calm_training.methods.fit_method import FitMethod, VectorMethod
from calm_training.posthoc import daca

__all__ = ["DACA", "DACA_VECTOR", "NAIVE"]

NAIVE = FitMethod("naive", needs_reference=True, token_level=True, p_true=True,
                  option_fit=partial(daca.fit_daca_temperature, mask=False),
                  p_true_fit=partial(daca.fit_daca_p_true, mask=False))
DACA = FitMethod("daca", needs_reference=True, masked=True, token_level=True, p_true=True,
                 option_fit=partial(daca.fit_daca_temperature, mask=True),
                 p_true_fit=partial(daca.fit_daca_p_true, mask=True))
DACA_VECTOR = VectorMethod("daca-vector", needs_reference=True, masked=True,
                           option_fit=daca.fit_daca_vector_scaling)
