"""``lora``: plain LoRA fine-tuning of θ on the answer's cross-entropy (no α, no warm start):
what CALM's θ would be without its calibration."""

from __future__ import annotations

from calm_training.methods.train_method import TrainMethod

__all__ = ["LORA"]

LORA = TrainMethod("lora", kind="lora", alpha=(), solver="descent")
