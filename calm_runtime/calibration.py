"""The one calibration formula (docs/methods.md §1) and its fused LM-head form.

    z_cal = (z / tau + shift) / T
    W'    = diag(1 / (tau * T)) @ W
    b'    = (b / tau + shift) / T

The functions work on numpy arrays and torch tensors alike (they only use elementwise
arithmetic and broadcasting), so training, export and every runtime backend call this
module instead of writing the formula again. Nothing here imports torch.
"""

from __future__ import annotations

import struct
from typing import Any

__all__ = ["apply_calibration", "fused_head", "is_identity", "TAU_RANGE", "TEMPERATURE_RANGE",
           "SHIFT_LIMIT", "as_float32"]

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


def apply_calibration(logits: Any, tau: Any = None, shift: Any = None, temperature: float = 1.0):
    """Return calibrated logits ``(logits / tau + shift) / temperature``.

    ``logits`` has the vocabulary on its last axis; ``tau`` and ``shift`` are ``[V]`` vectors
    (or ``None`` for the identity) and broadcast over the leading axes. Works for numpy
    arrays and torch tensors; the result has the type of ``logits``.
    """
    out = logits
    if tau is not None:
        out = out / tau
    if shift is not None:
        out = out + shift
    if temperature != 1.0:
        out = out / temperature
    return out


def fused_head(weight: Any, bias: Any = None, tau: Any = None, shift: Any = None,
               temperature: float = 1.0):
    """Fold the calibration into an LM head ``z = W h + b``.

    ``weight`` is ``[V, d]``; ``bias`` is ``[V]`` or ``None`` (a head without bias). Returns
    ``(W', b')`` with ``W' h + b' == apply_calibration(W h + b, tau, shift, temperature)``;
    ``b'`` is ``None`` only when the input had no bias and there is no shift.
    """
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
    """True when the transform changes nothing (tau = 1, shift = 0, T = 1)."""
    if temperature != 1.0:
        return False
    if tau is not None and bool((tau != 1).any()):
        return False
    return not (shift is not None and bool((shift != 0).any()))
