"""calm_runtime: calibrated confidences for language models, torch-free at import time.

The core needs numpy, safetensors and tokenizers; the ONNX Runtime backend comes from the
``cpu`` or ``gpu`` extra. torch is an optional backend, imported lazily.

    lm = CalibratedLM.load("engine/", backend="onnxruntime")
    out = lm.generate("Question: ...", max_new_tokens=32)
    out.text, out.tokens[0].confidence, out.sequence_confidence
    lm.choose(question, options), lm.p_true(question, answer)
"""

from ._version import __version__  # noqa: E402
from .artifact import CalibrationAdapter, ModelIdentity, tokenizer_sha256  # noqa: E402
from .backends import OnnxRuntimeBackend, TensorRTBackend, TorchBackend  # noqa: E402
from .calibration import apply_calibration, fused_head  # noqa: E402
from .errors import (  # noqa: E402
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
from .lm import CalibratedLM  # noqa: E402
from .results import Alternative, Choice, Generation, Timing, Token  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

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
