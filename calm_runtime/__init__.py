"""calm_runtime: calibrated confidences for language models, torch-free at import time.

The core needs numpy, safetensors and tokenizers; the ONNX Runtime backend comes from the
``cpu`` or ``gpu`` extra. torch is an optional backend, imported lazily.

    lm = CalibratedLM.load("engine/", backend="onnxruntime")
    out = lm.generate("Question: ...", max_new_tokens=32)
    out.text, out.tokens[0].confidence, out.sequence_confidence
    lm.choose(question, options), lm.p_true(question, answer)
"""

from calm_runtime._version import __version__
from calm_runtime.calibration import apply_calibration, fused_head
from calm_runtime.errors import (
    ArtifactError,
    BackendUnavailableError,
    CalmError,
    ConfigError,
    DataError,
    ExportValidationError,
    FitError,
    IncompatibleModelError,
    ModelSourceError,
    SchemaVersionError,
)
from calm_runtime.formats.artifact import CalibrationAdapter, ModelIdentity
from calm_runtime.formats.tokenizer_file import tokenizer_sha256
from calm_runtime.inference.backends import OnnxRuntimeBackend, TensorRTBackend, TorchBackend
from calm_runtime.inference.lm import CalibratedLM
from calm_runtime.inference.results import Alternative, Choice, Generation, Timing, Token
from calm_runtime.inference.sampling import SamplingParams

__all__ = [
    "__version__",
    "CalibrationAdapter",
    "ModelIdentity",
    "tokenizer_sha256",
    "apply_calibration",
    "fused_head",
    "CalmError",
    "ArtifactError",
    "SchemaVersionError",
    "IncompatibleModelError",
    "ConfigError",
    "DataError",
    "ModelSourceError",
    "FitError",
    "ExportValidationError",
    "BackendUnavailableError",
    "CalibratedLM",
    "Generation",
    "Token",
    "Alternative",
    "Timing",
    "Choice",
    "SamplingParams",
    "OnnxRuntimeBackend",
    "TorchBackend",
    "TensorRTBackend",
]
