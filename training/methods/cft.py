"""``cft``: calibration-aware fine-tuning, the training-time baseline (no α): θ trained on a
loss that reads every option and the starting model's confidence-bin accuracies
(:mod:`calm_training.calm.cft`)."""

from __future__ import annotations

from calm_training.methods.train_method import TrainMethod

__all__ = ["CFT"]

CFT = TrainMethod("cft", kind="cft", alpha=(), solver="descent", lower_loss="cft")
