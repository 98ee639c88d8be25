"""The values ``calm-export --format gguf`` reads from a source GGUF, checked before use.

The head (``output.weight``, or ``token_embd.weight`` when tied), its bias and the
embedding are read as values, as are the keys ``general.architecture`` and
``ARCH.final_logit_softcapping``. Each is checked against the model it belongs to (type,
shape, range) and what calm writes back is checked to be finite and representable in the
type written; a violation is one line naming the tensor or key and the fix. The file's
layout itself (counts, offsets, alignment) is checked before, by
calm_runtime/formats/gguf_layout.py.
"""

from __future__ import annotations

import math

import numpy as np

from calm_runtime.errors import ArtifactError, IncompatibleModelError

from .gguf_file import VALUE_TYPE_NAMES, GGUFSource, float32_problem

__all__ = ["BIAS", "EMBEDDING", "HEAD", "READABLE_TYPES", "check_architecture",
           "check_finite", "check_head_tensors", "check_written", "soft_cap", "written_cap"]

HEAD, BIAS, EMBEDDING = "output.weight", "output.bias", "token_embd.weight"
#: the ggml types calm reads as values (the head, its bias, a tied embedding): those the
#: gguf package dequantises. Others (F64, the integer types, Q8_1, ...) are refused in one
#: line before anything is read.
READABLE_TYPES = frozenset({
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
    "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
    "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4"})
_FLOAT_KEYS = (6, 12)  # float32, float64
_DAMAGED = "the file is damaged: use the original GGUF"


def check_architecture(source: GGUFSource, where: str) -> str:
    """``general.architecture``: a non-empty string (llama.cpp picks the graph by it)."""
    arch = source.string("general.architecture")
    if not arch:
        raise ArtifactError(f"{where} has no general.architecture string (llama.cpp picks the "
                            f"model's graph by it); {_DAMAGED}")
    return arch


def _require_readable(tensor, role: str, where: str) -> None:
    name = tensor.tensor_type.name
    if name not in READABLE_TYPES:
        raise IncompatibleModelError(
            f"{tensor.name} of {where} ({role}) has type {name}, which calm does not read as "
            "values (F32, F16, BF16 and llama.cpp's quantisations such as Q8_0 or Q4_K are "
            "read); re-convert the model with llama.cpp's convert_hf_to_gguf.py")


def check_head_tensors(source: GGUFSource, where: str, tied: bool):
    """``(head, rows, cols, bias or None)``: the head (``token_embd.weight`` when ``tied``)
    2-D and of a readable type, the embedding 2-D and (untied) of the head's shape, the bias
    of a readable type and one value per row."""
    tensors = source.tensors()
    head_name = EMBEDDING if tied else HEAD
    if head_name not in tensors:
        raise ArtifactError(f"{where} has neither {HEAD} nor {EMBEDDING}; it is "
                            "not a language model calm can calibrate")
    head = tensors[head_name]
    if len(head.shape) != 2:
        raise ArtifactError(f"{head_name} of {where} has {len(head.shape)} dimensions, not 2; "
                            f"cannot fold into it: {_DAMAGED}")
    _require_readable(head, "the head", where)
    cols, rows = (int(n) for n in head.shape)
    embedding = tensors.get(EMBEDDING)
    if embedding is not None and len(embedding.shape) != 2:
        raise ArtifactError(f"{EMBEDDING} of {where} has {len(embedding.shape)} dimensions, "
                            f"not 2 (vocabulary x width); {_DAMAGED}")
    if embedding is not None and not tied and \
            (int(embedding.shape[0]), int(embedding.shape[1])) != (cols, rows):
        raise ArtifactError(
            f"{HEAD} of {where} is {rows} x {cols} but {EMBEDDING} is "
            f"{int(embedding.shape[1])} x {int(embedding.shape[0])}: the head must have the "
            f"embeddings' width and vocabulary; {_DAMAGED}")
    bias = tensors.get(BIAS)
    if bias is not None:
        _require_readable(bias, "the head's bias", where)
        shape = [int(n) for n in bias.shape]
        if shape[0] != rows or math.prod(shape) != rows:
            raise ArtifactError(f"{BIAS} of {where} has shape {shape} but the head has {rows} "
                                f"rows: the bias holds one value per vocabulary entry; "
                                f"{_DAMAGED}")
    return head, rows, cols, bias


def check_finite(name: str, values: np.ndarray, where: str) -> None:
    """Source values (the head's rows, the bias) finite, else one line."""
    if np.isfinite(values).all():
        return
    if values.ndim == 2:
        bad = int((~np.isfinite(values)).any(axis=1).sum())
        what = f"in {bad} of {values.shape[0]} rows"
    else:
        what = f"({int((~np.isfinite(values)).sum())} of {values.size})"
    raise ArtifactError(f"{name} of {where} holds non-finite values {what}; {_DAMAGED}")


def check_written(values: dict, where: str, largest_scale: float) -> None:
    """What is written (``name -> float32 array or None``) finite: the division by tau T
    must not overflow float32."""
    for name, array in values.items():
        if array is not None and not np.isfinite(array).all():
            raise ArtifactError(
                f"the calibrated {name} of {where} overflows float32 (1/(tau T) up to "
                f"{largest_scale:.3g}); use an adapter whose tau and temperature are nearer "
                "1, or export --format onnx")


def soft_cap(source: GGUFSource, key: str, where: str) -> float:
    """The source's soft cap (0.0: none), checked: a float key whose value is 0 or a
    positive number float32 holds, as llama.cpp reads it."""
    found = source.key(key)
    if found is None:
        return 0.0
    if found.kind not in _FLOAT_KEYS:
        raise ArtifactError(f"{key} of {where} has value type "
                            f"{VALUE_TYPE_NAMES.get(found.kind, found.kind)}, not float32 (as "
                            "llama.cpp reads it); re-convert the model with llama.cpp")
    cap = float(found.value)
    problem = "negative" if cap < 0 else float32_problem(cap)
    if problem is not None:
        raise ArtifactError(f"{key} of {where} is {cap!r}, {problem}: a soft cap is 0 (none) "
                            f"or a positive float32; {_DAMAGED}")
    return cap


def written_cap(key: str, cap: float, scale: float) -> float:
    """The cap divided by ``scale`` (tau T), as it is written: a normal float32 or one line."""
    written = cap / scale
    problem = float32_problem(written)
    if problem is not None:
        raise ArtifactError(
            f"{key} {cap:g} divided by tau T ({scale:.3g}) is {written:.3g}, {problem}, so "
            "the calibrated GGUF cannot hold it as float32; use an adapter whose temperature "
            "is nearer 1, or export --format onnx")
    return written
