"""Merge the LoRA, untie the embedding, and fuse the calibration into the LM head.

The math is :func:`calm_runtime.calibration.fused_head` (docs/methods.md §1), called through
:meth:`CalibrationAdapter.fused_head`; nothing here re-derives it.

Head layout (``ExportConfig.head_layout``), measured on SmolLM2-135M-Instruct (tied, vocab
49,152, fp32, ONNX Runtime 1.32 CPU, 64-token prefill + 40 decode steps, one thread):

==========================  ===========  ==============  ==============  =============
layout                      model.onnx   session RSS     decode / step   prefill (64)
==========================  ===========  ==============  ==============  =============
``untied`` (default)        656 MB       819-822 MB      32-35 ms        198-211 ms
``tied-scale``              543 MB       809-812 MB      33-52 ms        294-295 ms
==========================  ===========  ==============  ==============  =============

* ``"untied"``: the head gets its own copy ``W' = W / (tau T)`` and bias
  ``b' = (b / tau + l) / T``; the embedding keeps ``W``. One MatMul + Add, which every
  runtime, quantiser and TensorRT handle as a plain linear layer.
* ``"tied-scale"``: the tie is kept and the head's MatMul is followed by elementwise
  ``* scale + shift`` (``scale = 1 / (tau T)``, ``shift = b'``: the fused head of a
  ``[V, 1]`` column of ones). The file is 113 MB smaller, but the saving does not reach
  the runtime: the shared matrix feeds the head through a ``Transpose`` that ONNX
  Runtime constant-folds into a second ``[d, V]`` initializer at session load (checked
  in the optimised graph), so resident memory is the same, and the two extra ``[B, S, V]``
  elementwise passes make prefill slower. The TorchScript exporter even folds the
  transpose into the file itself.

So ``untied`` is the default: same memory where it matters, a standard graph, and it is
what docs/methods.md §1 prescribes. ``tied-scale`` stays available for disk-bound deployments.
(Export itself peaked at 3.35 GB RSS untied vs 2.84 GB tied-scale.)
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from calm_runtime.calibration import center_logits, fused_head
from calm_runtime.data.models import load_lora
from calm_runtime.errors import ArtifactError
from calm_runtime.formats.artifact import CalibrationAdapter

__all__ = [
    "LogitsAffine",
    "ScaledHead",
    "apply_lora",
    "fuse_into_lm_head",
    "head_is_tied",
    "elementwise_calibration",
    "logits_affine",
    "merge_lora",
    "untie_lm_head",
]

logger = logging.getLogger(__name__)


class ScaledHead(nn.Module):
    """A (possibly tied) linear head followed by an elementwise scale and shift (after
    centring its output over the vocabulary, for a centred adapter)."""

    def __init__(self, linear: nn.Linear, scale: torch.Tensor, shift: torch.Tensor, *,
                 center: bool = False) -> None:
        super().__init__()
        self.linear = linear
        self.center = center
        self.register_buffer("scale", scale.detach().clone())
        self.register_buffer("shift", shift.detach().clone())

    @property
    def weight(self) -> torch.Tensor:  # lets transformers treat it like a Linear head
        return self.linear.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        z = self.linear(hidden)
        return (center_logits(z) if self.center else z) * self.scale + self.shift


class LogitsAffine(nn.Module):
    """``logits * scale + shift`` after the model's own logits: the calibration of a family
    whose head is followed by a non-linear transform (soft-capping, export/heads.py)."""

    def __init__(self, scale: torch.Tensor, shift: torch.Tensor, *, center: bool = False
                 ) -> None:
        super().__init__()
        self.center = center
        self.register_buffer("scale", scale.detach().clone())
        self.register_buffer("shift", shift.detach().clone())

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return (center_logits(logits) if self.center else logits) * self.scale + self.shift


def elementwise_calibration(adapter: CalibrationAdapter, ones: torch.Tensor, bias=None):
    """``(scale, shift)`` with ``calibrate(z + bias) == center?(z) * scale + shift`` for a head
    output ``z`` without bias: the fused head of a ``[V, 1]`` column ``ones`` (the head's
    multiplier) with the bias centred here when the adapter is (the column is not centred:
    the module centres ``z`` itself)."""
    tau = torch.as_tensor(adapter.tau, dtype=ones.dtype, device=ones.device)
    shift = torch.as_tensor(adapter.shift, dtype=ones.dtype, device=ones.device)
    if adapter.centered and bias is not None:
        bias = bias - bias.mean()
    return fused_head(ones, bias, tau, shift, adapter.temperature)


def logits_affine(adapter: CalibrationAdapter, vocab_size: int,
                  multiplier: float = 1.0) -> LogitsAffine:
    """The calibration as elementwise ops on finished logits: ``(z / tau + l) / T`` (``z``
    centred first for a centred adapter); ``multiplier``: a family's scaling of the head
    output, folded into the scale (the caller neutralises the family's own)."""
    scale, shift = elementwise_calibration(adapter, torch.full((vocab_size, 1), multiplier),
                                           torch.zeros(vocab_size))
    return LogitsAffine(scale[:, 0], shift, center=adapter.centered)


def keeps_tied_head(model, adapter: CalibrationAdapter, config) -> bool:
    """Whether the builder's engine keeps a tied head and calibrates after it: where tau is
    one number (a temperature fit, or none), ``W / (tau T)`` needs no copy of the embedding
    (``z * s + shift`` after the shared head gives the same logits), so the engine is no
    larger than the builder's own. Only for the builder route (calm's own graph keeps its
    measured untied head, see :func:`fuse_into_lm_head`), without centring, and for a head
    without a bias."""
    head = model.get_output_embeddings()
    tau = np.asarray(adapter.tau, np.float64)
    return (config.output.onnx_engine and config.graph in ("auto", "builder")
            and config.head_layout == "untied" and head_is_tied(model)
            and getattr(head, "bias", None) is None and not adapter.centered
            and bool(np.all(tau == tau.flat[0])))


def head_is_tied(model) -> bool:
    """True when the LM head shares its weight storage with the input embedding."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embedding is None:
        return False
    head_weight = head.weight
    return head_weight is embedding.weight or (
        head_weight.data_ptr() == embedding.weight.data_ptr())


def _set_untied_config(model) -> None:
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        if getattr(config, "tie_word_embeddings", False):
            config.tie_word_embeddings = False


def untie_lm_head(model) -> bool:
    """Give the LM head its own copy of a tied weight; the embedding keeps the original.

    Returns whether the model was tied. Done before the LoRA is applied, so a LoRA that
    targets the head cannot leak into the embedding when it is merged.
    """
    tied = head_is_tied(model)
    if tied:
        head = model.get_output_embeddings()
        with torch.no_grad():
            head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        logger.info("untied the LM head from the input embedding (%d x %d copied)",
                    *head.weight.shape)
    _set_untied_config(model)
    return tied


def apply_lora(model, lora_path: str | Path):
    """Wrap ``model`` with the peft LoRA in ``lora_path`` (not merged: the reference)."""
    return load_lora(model, lora_path, extra="export")


def merge_lora(peft_model):
    """Merge the LoRA weights into the base model and drop the peft wrappers."""
    with torch.no_grad():
        merged = peft_model.merge_and_unload()
    merged.eval()
    return merged


#: rows of a half-precision head rescaled in float32 at a time
HALF_FUSE_ROWS = 8192


def _fused_half_head(adapter: CalibrationAdapter, weight: torch.Tensor, bias):
    """``adapter.fused_head`` for a float16/bfloat16 head, computed in float32 a block of rows
    at a time and rounded once into the head's dtype (no float32 copy of the head). The bias
    (the shift) stays float32: the builder graph adds it after the head in float32."""
    vocab = weight.shape[0]
    scale, shift = elementwise_calibration(
        adapter, torch.ones((vocab, 1), dtype=torch.float32),
        None if bias is None else bias.float())
    mean = None
    if adapter.centered:  # the rows' mean, for the centred logits z - mean(z)
        mean = torch.zeros(weight.shape[1], dtype=torch.float64)
        for start in range(0, vocab, HALF_FUSE_ROWS):
            mean += weight[start:start + HALF_FUSE_ROWS].double().sum(0)
        mean = (mean / vocab).float()
    fused = torch.empty_like(weight)
    for start in range(0, vocab, HALF_FUSE_ROWS):
        rows = weight[start:start + HALF_FUSE_ROWS].float()
        if mean is not None:
            rows -= mean
        fused[start:start + HALF_FUSE_ROWS] = rows * scale[start:start + HALF_FUSE_ROWS]
    return fused, shift


def fuse_into_lm_head(model, adapter: CalibrationAdapter, *, layout: str = "untied",
                      multiplier: float = 1.0) -> None:
    """Replace the LM head in place so that it outputs calibrated logits.

    ``multiplier`` is a family's scaling of the head output (export/heads.py, ``scale``):
    it is folded in too, and the caller sets the family's own scaling to 1.

    ``layout="untied"`` needs an untied head (call :func:`untie_lm_head` first); it becomes
    ``nn.Linear(d, V, bias=True)`` with ``(W', b') = adapter.fused_head(W, b)``.
    ``layout="tied-scale"`` keeps the head's weight (shared or not) and appends
    :class:`ScaledHead`'s elementwise ops. Note that ``save_pretrained`` would drop the
    added bias: export from the in-memory model.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ArtifactError(f"the model's LM head is a {type(head).__name__}, not a Linear "
                            "layer; calm-export can only fuse into a linear head")
    weight = head.weight.detach()
    if multiplier != 1.0:
        weight = weight * multiplier
    bias = None if head.bias is None else head.bias.detach() * multiplier
    embedding = model.get_input_embeddings()
    width = None if embedding is None else getattr(embedding, "weight", None)
    if weight.ndim != 2 or 0 in weight.shape or (
            width is not None and width.ndim == 2 and weight.shape[1] != width.shape[1]):
        raise ArtifactError(
            f"the model's LM head has shape {tuple(weight.shape)}, which does not match its "
            f"embeddings{'' if width is None else f' ({tuple(width.shape)})'}: a head needs "
            "the embeddings' width and one row per token; the model files are damaged")
    if not bool(torch.isfinite(weight).all()) or (bias is not None
                                                  and not bool(torch.isfinite(bias).all())):
        raise ArtifactError("the model's LM head holds non-finite values (NaN or inf); the "
                            "model files are damaged: use the original weights")
    if weight.shape[0] != adapter.base_model.vocab_size:
        from calm_runtime.errors import IncompatibleModelError

        raise IncompatibleModelError(
            f"the adapter is for a vocabulary of {adapter.base_model.vocab_size} tokens but the "
            f"model's head has {weight.shape[0]} rows; use an adapter made for this model")
    with torch.no_grad():
        if layout == "untied":
            if head_is_tied(model):
                raise ArtifactError("the LM head is still tied to the embedding; call "
                                    "untie_lm_head first (fusing would rescale the embedding)")
            if weight.dtype in (torch.float16, torch.bfloat16):
                new_weight, new_bias = _fused_half_head(adapter, weight, bias)
            else:
                new_weight, new_bias = adapter.fused_head(weight, bias)
            # made on the meta device: no [V, d] initialisation beside the two real heads
            fused = nn.Linear(weight.shape[1], weight.shape[0], bias=True,
                              dtype=weight.dtype, device="meta")
            fused.weight = nn.Parameter(new_weight.contiguous(), requires_grad=False)
            fused.bias = nn.Parameter(new_bias.contiguous(), requires_grad=False)
            model.set_output_embeddings(fused)
        elif layout == "tied-scale":
            ones = torch.full((weight.shape[0], 1), multiplier, dtype=weight.dtype,
                              device=weight.device)
            scale, shift = elementwise_calibration(adapter, ones, bias)
            plain = nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                              dtype=weight.dtype, device="meta")
            plain.weight = head.weight  # keep the tie: same Parameter as the embedding
            model.set_output_embeddings(ScaledHead(plain, scale[:, 0], shift,
                                                   center=adapter.centered))
        else:
            raise ArtifactError(f"unknown head layout {layout!r}")
    logger.info("fused the calibration into the LM head (%s layout)", layout)
