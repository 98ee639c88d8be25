"""What a family does to its logits after the LM head, and how the calibration goes with it.

The calibration applies to the model's output logits ``z = post(W h + b)``. Most families
have no ``post``; three kinds are known (docs/architectures.md):

* ``scale``: ``z = s (W h + b)`` — Granite divides by ``logits_scaling``, Cohere multiplies
  by ``logit_scale``. ``(s z' / tau + l) / T`` is the calibration of the raw head output
  with ``tau / s``: it folds into the head exactly (``W' = s W / (tau T)``), and the
  family's own multiplier is set to 1.
* ``softcap``: ``z = c tanh((W h + b) / c)`` — Gemma-2 (``final_logit_softcapping``). Not
  linear, so nothing folds into the head: the engine keeps the cap and applies the
  calibration after it as elementwise ops, ``z * 1/(tau T) + l/T``. A transformers
  checkpoint (``--format hf``) can hold it only when tau is one number and l = 0: then
  ``c tanh(u / c) / k = (c/k) tanh((u/k) / (c/k))``, i.e. the head divided by ``k = tau T``
  and the cap set to ``c / k``.
* ``none``.

:func:`check_post_head` runs the model once and checks that its logits are ``post`` of its
head's output, so a family with a transform calm does not know fails with a one-line
error naming it instead of a parity mismatch.
"""

from __future__ import annotations

import logging

from calm_runtime.errors import ExportValidationError
from calm_runtime.inference.post_head import PostHead, model_configs, post_head

__all__ = ["PostHead", "check_post_head", "neutralise", "post_head"]

logger = logging.getLogger(__name__)

#: |model logits - post(head output)| allowed by :func:`check_post_head` (same arithmetic
#: in the same order, so only float rounding of the post-head op itself).
_PROBE_ATOL = 1e-4


def neutralise(model, post: PostHead) -> None:
    """Set a ``scale`` transform to 1 in the model (its multiplier now lives in the head)."""
    if not post.folded_away:
        return
    for config in model_configs(model):
        if hasattr(config, post.field):
            setattr(config, post.field, 1.0)
    for module in model.modules():  # Cohere copies logit_scale onto the module at init
        if post.field == "logit_scale" and isinstance(getattr(module, "logit_scale", None),
                                                      (int, float)):
            module.logit_scale = 1.0
    logger.info("folded the family's %s into the LM head", post.describe())


def check_post_head(model, post: PostHead, input_ids) -> None:
    """Run ``model`` on ``input_ids`` (int64 numpy) and check ``logits == post(head(hidden))``.

    Raises :class:`ExportValidationError` naming the model type when the logits come out of
    something calm does not know (nothing has been written at this point).
    """
    import torch

    head = model.get_output_embeddings()
    captured = {}
    hook = head.register_forward_hook(lambda _m, _i, out: captured.setdefault("out", out))
    try:
        with torch.inference_mode():
            logits = model(input_ids=torch.from_numpy(input_ids)).logits
    finally:
        hook.remove()
    model_type = getattr(model.config, "model_type", type(model).__name__)
    if "out" not in captured:
        raise ExportValidationError(
            f"the {model_type} model's logits do not come from its output embedding "
            f"({type(head).__name__}); calm-export cannot fuse the calibration into this "
            "architecture")
    expected = post.apply(captured["out"].float())
    diff = float((logits.float() - expected).abs().max())
    if not diff <= _PROBE_ATOL * max(1.0, float(expected.abs().max())):
        known = "" if post.identity else f" besides {post.describe()}"
        raise ExportValidationError(
            f"the {model_type} model transforms its logits after the LM head in a way "
            f"calm-export does not know{known} (max |logits - head output| {diff:.3g}); "
            "its calibration cannot be fused exactly; nothing was written")
