"""What a model family does to its logits after the LM head (torch-free).

The calibration applies to the model's output logits ``z = post(W h + b)``. Known kinds:
``scale`` (Granite's ``logits_scaling``, Cohere's ``logit_scale``), ``softcap`` (Gemma-2's
``final_logit_softcapping``) and ``none``. Training computes logits with :meth:`PostHead.apply`;
the export folds or appends the calibration accordingly (docs/architectures.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["PostHead", "model_configs", "post_head"]


@dataclass(frozen=True)
class PostHead:
    """The op between the LM head and the model's logits."""

    kind: str = "none"  # "none" | "scale" | "softcap"
    #: scale: the multiplier ``s``; softcap: the cap ``c``; none: 1.
    value: float = 1.0
    #: The config field it comes from ("logits_scaling", "logit_scale",
    #: "final_logit_softcapping"), or None.
    field: str | None = None

    @property
    def identity(self) -> bool:
        """No op after the head."""
        return self.kind == "none"

    @property
    def linear(self) -> bool:
        """A multiplication (or nothing): it folds into the head's weights
        (:attr:`head_multiplier`); a soft cap does not, and the calibration goes after it."""
        return self.kind in ("none", "scale")

    @property
    def head_multiplier(self) -> float:
        """What folding the op into the head multiplies it by (1 when there is nothing to fold
        or it is not linear)."""
        return self.value if self.kind == "scale" else 1.0

    @property
    def folded_away(self) -> bool:
        """A multiplier the export moves into the head and sets to 1 in the model."""
        return self.kind == "scale"

    def apply(self, logits):
        """``post(logits)`` for numpy arrays or torch tensors."""
        if self.kind == "scale":
            return logits * self.value
        if self.kind == "softcap":
            if isinstance(logits, np.ndarray):
                return np.tanh(logits / self.value) * self.value
            return (logits / self.value).tanh() * self.value
        return logits

    def describe(self) -> str:
        if self.kind == "scale":
            return f"logits scaled by {self.value:g} ({self.field})"
        if self.kind == "softcap":
            return f"tanh soft-capping at {self.value:g} ({self.field})"
        return "none"

    def to_dict(self) -> dict:
        return asdict(self)


def model_configs(model) -> list:
    """The model's config and its text config (one object when they are the same)."""
    config = model.config
    text = config.get_text_config(decoder=True)
    return [c for c in {id(c): c for c in (config, text)}.values()]


def post_head(model) -> PostHead:
    """Read the post-head transform from ``model``'s config (text part for multimodal)."""
    for config in model_configs(model):
        cap = getattr(config, "final_logit_softcapping", None)
        if cap is not None and float(cap) > 0:
            return PostHead("softcap", float(cap), "final_logit_softcapping")
    for config in model_configs(model):
        divisor = getattr(config, "logits_scaling", None)
        if divisor is not None and float(divisor) != 1.0:
            return PostHead("scale", 1.0 / float(divisor), "logits_scaling")
        multiplier = getattr(config, "logit_scale", None)
        if multiplier is not None and float(multiplier) != 1.0:
            return PostHead("scale", float(multiplier), "logit_scale")
    return PostHead()
