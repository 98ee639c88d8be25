"""The one calibration formula (docs/methods.md §1) and its fused LM-head form.

    z_cal = (z / tau + shift) / T
    W'    = diag(1 / (tau * T)) @ W
    b'    = (b / tau + shift) / T

With ``center=True`` (a *centred* adapter) the logits are first taken relative to their
mean over the vocabulary, ``z_c = z - mean_v z``, which gives a per-token temperature a
reference point (docs/methods.md §1): at the identity nothing changes (the softmax does not
see a common offset), and the fused form stays one linear layer:

    z_cal = ((z - mean_v z) / tau + shift) / T
    W'    = diag(1 / (tau * T)) @ (W - 1 w_mean^T)      (w_mean: the mean row of W)
    b'    = ((b - mean(b)) / tau + shift) / T

The functions work on numpy arrays and torch tensors alike (they only use elementwise
arithmetic and broadcasting), so training, export and every runtime backend call this
module instead of writing the formula again. Nothing here imports torch.
"""

from __future__ import annotations

import struct
from typing import Any

__all__ = ["apply_calibration", "fused_head", "center_logits", "center_head", "is_identity",
           "TAU_RANGE", "TEMPERATURE_RANGE", "SHIFT_LIMIT", "as_float32"]

#: The documented range of every tau entry (docs/formats.md): inside these ranges the
#: calibrated logits of float32 logits stay finite. Checked by the adapter and the engine
#: loaders, in float32 (see :func:`as_float32`).
TAU_RANGE = (1e-4, 1e4)
#: The documented range of ``temperature`` and ``answer_temperature``.
TEMPERATURE_RANGE = (1e-4, 1e4)
#: ``|shift| <= SHIFT_LIMIT`` for every shift entry.
SHIFT_LIMIT = 1e4


def as_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (``1e-4`` becomes ``9.9999997e-05``).

    Every range check compares against the float32 form of its bounds, so a value the
    range admits still passes after it was stored as float32 and read back.
    """
    return struct.unpack("<f", struct.pack("<f", value))[0]


def center_logits(logits: Any):
    """``logits - mean_v logits`` (the mean over the last, vocabulary axis; numpy or torch)."""
    return logits - logits.mean(axis=-1, keepdims=True)


def center_head(weight: Any, bias: Any = None):
    """The head whose outputs are the centred logits of ``z = W h + b``:
    ``(W - 1 w_mean^T, b - mean(b))`` (``bias`` None stays None: its mean is 0)."""
    new_weight = weight - weight.mean(axis=0, keepdims=True)
    return new_weight, None if bias is None else bias - bias.mean()


def apply_calibration(logits: Any, tau: Any = None, shift: Any = None, temperature: float = 1.0,
                      *, center: bool = False):
    """Return calibrated logits ``(logits / tau + shift) / temperature``.

    ``logits`` has the vocabulary on its last axis; ``tau`` and ``shift`` are ``[V]`` vectors
    (or ``None`` for the identity) and broadcast over the leading axes. ``center`` first
    subtracts the mean over the vocabulary (:func:`center_logits`). Works for numpy arrays
    and torch tensors; the result has the type of ``logits``.
    """
    out = center_logits(logits) if center else logits
    if tau is not None:
        out = out / tau
    if shift is not None:
        out = out + shift
    if temperature != 1.0:
        out = out / temperature
    return out


def fused_head(weight: Any, bias: Any = None, tau: Any = None, shift: Any = None,
               temperature: float = 1.0, *, center: bool = False):
    """Fold the calibration into an LM head ``z = W h + b``.

    ``weight`` is ``[V, d]``; ``bias`` is ``[V]`` or ``None`` (a head without bias). Returns
    ``(W', b')`` with ``W' h + b' == apply_calibration(W h + b, tau, shift, temperature,
    center=center)``; ``b'`` is ``None`` only when the input had no bias and there is no
    shift.
    """
    if center:
        weight, bias = center_head(weight, bias)
    scale_is_identity = tau is None and temperature == 1.0
    if scale_is_identity:
        new_weight = weight
    else:
        new_weight = weight * _reciprocal_row_scale(weight, tau, temperature)[:, None]
    if bias is None and shift is None:
        return new_weight, None
    if bias is None:
        new_bias = apply_calibration(shift * 0.0, tau, shift, temperature)
    else:
        new_bias = apply_calibration(bias, tau, shift, temperature)
    return new_weight, new_bias


def _reciprocal_row_scale(weight: Any, tau: Any, temperature: float):
    """``1 / (tau * T)`` as a ``[V]`` array of the weight's type."""
    if tau is None:
        one = weight[:, 0] * 0.0 + 1.0
        return one / temperature
    return 1.0 / (tau * temperature)


def is_identity(tau: Any = None, shift: Any = None, temperature: float = 1.0) -> bool:
    """True when the transform changes nothing (tau = 1, shift = 0, T = 1; centring then
    changes nothing either)."""
    if temperature != 1.0:
        return False
    if tau is not None and bool((tau != 1).any()):
        return False
    return not (shift is not None and bool((shift != 0).any()))
