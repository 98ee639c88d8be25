"""The upper objectives ``f`` of ``calm train`` (``--set upper``): ``entropy``, the paper's
negative entropy of the option distribution, and ``daca``, calm's extension: DACA's
agreement-masked KL to a pre-trained reference."""

from __future__ import annotations

from calm_training.methods.train_method import UpperObjective

__all__ = ["DACA_UPPER", "ENTROPY"]

ENTROPY = UpperObjective("entropy")
DACA_UPPER = UpperObjective("daca", needs_reference=True, options_only=True)
