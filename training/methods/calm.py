"""CALM (docs/methods.md §4): LoRA weights θ and a per-vocabulary α = (τ, shift) trained
together, θ on the lower objective (the answer's cross-entropy) and α on the upper one,
coupled by BOME (``bilevel``); its ablations: ``regularization`` (min g + β f), ``iterate-theta``
(alternate a θ step on g and a (θ, α) step on f, no coupling), ``iterate-alpha`` (alternate a θ
step on g and an α step on f, no coupling) and ``scalar`` (BOME with α one learned
temperature)."""

from __future__ import annotations

from calm_training.methods.train_method import TrainMethod

__all__ = ["BILEVEL", "ITERATE_ALPHA", "ITERATE_THETA", "REGULARIZATION", "SCALAR"]

BILEVEL = TrainMethod("bilevel", kind="calm")
REGULARIZATION = TrainMethod("regularization", kind="calm_regularization",
                             solver="regularization")
ITERATE_THETA = TrainMethod("iterate-theta", kind="calm_iterate_theta", solver="iterate",
                            theta_path=True)
ITERATE_ALPHA = TrainMethod("iterate-alpha", kind="calm_iterate_alpha", solver="iterate")
SCALAR = TrainMethod("scalar", kind="calm_scalar", alpha=("log_temperature",))
