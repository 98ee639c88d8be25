"""The reference model's option distributions on the calibration questions: the target of
CALM's ``daca`` upper objective (calm's extension, docs/methods.md §4).

``f(θ, α) = Σ_agree KL(p_ref ‖ p_α)`` over the unlabeled calibration questions where the
reference's top option is the model's: DACA's masked objective (§3) used as the upper
level. It is label-free like the paper's entropy, but its optimum is the reference's
confidence rather than the uniform distribution.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from calm_runtime.data.sets import MultipleChoiceRecord
from calm_runtime.errors import ConfigError

__all__ = ["reference_option_probs", "with_reference"]

logger = logging.getLogger(__name__)


def reference_option_probs(reference: str, records: Sequence, *, mode: str, variant: str,
                           chat: bool | None, max_length: int, batch_size: int = 8,
                           progress: bool = True, dtype: str = "float32",
                           device: str = "cpu") -> np.ndarray:
    """``[N, k_max]`` option probabilities of the ``reference`` model (packaged name, folder
    or .gguf) on multiple-choice ``records``, scored as the trained model's options are."""
    from calm_runtime.data.models import load_model_and_tokenizer
    from calm_runtime.modes import option_probabilities
    from calm_training.scoring.local import score_multiple_choice

    bad = sum(1 for r in records if not isinstance(r, MultipleChoiceRecord))
    if bad:
        raise ConfigError(f"the daca upper objective compares option distributions; {bad} "
                          "calibration records are not multiple choice: use --set upper=entropy")
    model, tokenizer, identity = load_model_and_tokenizer(reference, dtype=dtype, device=device)
    logger.info("scoring %d calibration questions with the reference %s", len(records),
                identity.name)
    scores = score_multiple_choice(model, tokenizer, list(records), mode=mode,
                                   batch_size=batch_size, chat=chat, progress=progress,
                                   max_length=max_length)
    del model
    return option_probabilities(scores.scores(variant))


def with_reference(examples: Sequence, probs: np.ndarray) -> list:
    """The calibration ``examples`` (option-entropy ones) carrying their reference row."""
    out = []
    for example, row in zip(examples, probs, strict=True):
        k = max(example.options) + 1
        out.append(replace(example, reference=tuple(float(v) for v in row[:k])))
    return out
