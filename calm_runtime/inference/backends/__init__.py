"""Backends: small runner classes behind one interface, chosen by an explicit argument.

Each backend runs the engine's decoder step (``input_ids``, ``attention_mask`` over past +
current tokens, ``position_ids``, KV cache) and returns float32 **calibrated** logits as a
numpy array; none of them computes confidences (that is :mod:`calm_runtime.inference.sampling`).

* :class:`OnnxRuntimeBackend` (``"onnxruntime"``): ``model.onnx`` with the CPU, CUDA or
  TensorRT execution provider (IO binding keeps the KV cache on the GPU); on a packed
  engine (onnxruntime-genai's builder graph) it is a :class:`PackedOnnxRuntimeBackend`;
* :class:`TorchBackend` (``"torch"``): the merged transformers model with the calibration
  applied by :mod:`calm_runtime.calibration` (the reference; also for GPUs without
  onnxruntime-gpu);
* :class:`TensorRTBackend` (``"tensorrt"``): the ``model.plan`` of a ``kind: tensorrt`` engine.

onnxruntime, torch and tensorrt are imported only when their backend is created. A pass
that cannot allocate its memory raises :class:`BackendMemoryError` (a ``MemoryError``).
"""

from __future__ import annotations

from calm_runtime.errors import ConfigError
from calm_runtime.inference.backends._base import Backend, BackendMemoryError
from calm_runtime.inference.backends._onnxruntime import (
    OnnxRuntimeBackend,
    PackedOnnxRuntimeBackend,
)
from calm_runtime.inference.backends._tensorrt import TensorRTBackend
from calm_runtime.inference.backends._torch import TorchBackend

__all__ = ["Backend", "BackendMemoryError", "OnnxRuntimeBackend", "PackedOnnxRuntimeBackend",
           "TorchBackend",
           "TensorRTBackend", "BACKENDS", "create_backend"]

BACKENDS: dict[str, type[Backend]] = {
    "onnxruntime": OnnxRuntimeBackend,
    "torch": TorchBackend,
    "tensorrt": TensorRTBackend,
}


def create_backend(name: str, manifest, **options) -> Backend:
    """The backend ``name`` (a key of :data:`BACKENDS`) on a loaded engine manifest."""
    cls = BACKENDS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return cls(manifest, **options)
