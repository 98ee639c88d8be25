"""``platt``: Platt scaling of P(True) (a slope and an intercept on its log-odds), compared by
``calm eval --compare --mode p_true`` and not yet written as an adapter. The fit itself:
:mod:`calm_training.posthoc.platt`."""

from __future__ import annotations

from calm_training.methods.fit_method import FitMethod
from calm_training.posthoc.platt import fit_platt

__all__ = ["PLATT"]

PLATT = FitMethod("platt", needs_labels=True, choice=False, p_true=True, p_true_fit=fit_platt,
                  writes_adapter=False,
                  refusal="Platt scaling is compared by calm eval --compare but not written as "
                          "an adapter yet (it needs a shift on the true token)")
