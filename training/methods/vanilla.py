"""``vanilla``: the uncalibrated baseline, compared in every mode and never written."""

from __future__ import annotations

from calm_training.methods.fit_method import FitMethod

__all__ = ["VANILLA"]

VANILLA = FitMethod("vanilla", p_true=True, writes_adapter=False,
                    refusal="vanilla is the uncalibrated baseline")
