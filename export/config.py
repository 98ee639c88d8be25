"""ExportConfig: every setting of ``calm-export`` in one frozen, checked dataclass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import ClassVar

from calm_runtime.errors import ConfigError
from calm_runtime.prompts import p_true_template

__all__ = ["ExportConfig"]

FORMATS = ("onnx", "tensorrt")
DTYPES = ("fp32", "fp16")
EXPORTERS = ("auto", "dynamo", "torchscript")
HEAD_LAYOUTS = ("untied", "tied-scale")


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """How to build an engine. Validation cannot be turned off; its tolerance can be named."""

    #: Tolerance for float32 engines, on calibrated logits: ``|engine - reference| <= ATOL_FP32
    #: + RTOL_FP32 * max|reference|``. ONNX Runtime's kernels sum in another order than
    #: torch's (blocked GEMMs, fused attention), ~1e-7 relative per op, growing with depth:
    #: measured 2.7e-4 on SmolLM2-135M (30 layers, |logits| up to ~33, tolerance 3.4e-3) and
    #: ~4e-6 on the 2-layer test models. A wrong fusion (a missing 1/T, a tau applied to the
    #: embedding, an unmerged LoRA) moves logits by 1e-2 or more.
    ATOL_FP32: ClassVar[float] = 1e-4
    RTOL_FP32: ClassVar[float] = 1e-4
    #: Tolerance for TensorRT fp16 engines: fp16 keeps 11 significant bits (~5e-4 relative
    #: per rounding) and accumulates over every layer, so logits move by ~1e-2 relative.
    ATOL_FP16: ClassVar[float] = 5e-2
    RTOL_FP16: ClassVar[float] = 2e-2
    #: Above this many bytes of weights the graph keeps them in ``model.onnx.data``: a single
    #: protobuf file cannot exceed 2 GiB, and staying well below keeps loading simple.
    EXTERNAL_DATA_BYTES: ClassVar[int] = 1 << 30

    #: "onnx" (ONNX Runtime, onnxruntime-genai) or "tensorrt" (needs the tensorrt extra + GPU).
    format: str = "onnx"
    #: Weight and activation precision of the engine ("fp16" only for TensorRT for now).
    dtype: str = "fp32"
    #: Weight quantisation (not implemented yet; only ``None`` is accepted).
    quantize: str | None = None
    #: ONNX opset of the exported graph.
    opset: int = 18
    #: "dynamo" (torch.export), "torchscript" (legacy tracer) or "auto" (dynamo, then the
    #: TorchScript exporter if dynamo fails; the engine is validated either way).
    exporter: str = "auto"
    #: "untied": a tied embedding is copied and the head becomes ``W/(tau T) h + b'`` (one
    #: MatMul + Add). "tied-scale": the tie is kept and the head's MatMul is followed by an
    #: elementwise scale and shift. See export/fuse.py for the measurement behind the default.
    head_layout: str = "untied"
    #: Write the weights as ONNX external data: ``None`` decides by EXTERNAL_DATA_BYTES.
    external_data: bool | None = None
    #: Greedy KV-cache steps compared during validation (batch 1 and batch 2).
    greedy_steps: int = 20
    #: Absolute tolerance override for the validation (``None``: the dtype's named constants).
    atol: float | None = None
    #: P(True) template recorded in the engine: a built-in name or a template mapping;
    #: ``None`` takes the adapter's recorded template, else the default ("kadavath").
    p_true_template: str | Mapping | None = None
    #: Replace an existing output directory (only after the new engine passed validation).
    overwrite: bool = False
    #: Show tqdm progress bars.
    progress: bool = True
    #: TensorRT optimisation profile bounds (batch and total sequence length).
    max_batch_size: int = 8
    max_sequence_length: int = 2048

    def __post_init__(self) -> None:
        problems = []
        if self.format not in FORMATS:
            problems.append(f"format must be one of {list(FORMATS)}, got {self.format!r}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        elif self.dtype == "fp16" and self.format != "tensorrt":
            problems.append("dtype fp16 is only implemented for --format tensorrt so far; use "
                            "--dtype fp32 for ONNX")
        if self.quantize is not None:
            problems.append(f"quantize {self.quantize!r} is not implemented yet; leave it unset")
        if isinstance(self.opset, bool) or not isinstance(self.opset, int) \
                or not 14 <= self.opset <= 23:
            problems.append(f"opset must be an integer in [14, 23], got {self.opset!r}")
        if self.exporter not in EXPORTERS:
            problems.append(f"exporter must be one of {list(EXPORTERS)}, got {self.exporter!r}")
        if self.head_layout not in HEAD_LAYOUTS:
            problems.append(f"head_layout must be one of {list(HEAD_LAYOUTS)}, got "
                            f"{self.head_layout!r}")
        if self.external_data not in (None, True, False):
            problems.append(f"external_data must be true, false or None, got "
                            f"{self.external_data!r}")
        for name, low in (("greedy_steps", 1), ("max_batch_size", 1),
                          ("max_sequence_length", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                problems.append(f"{name} must be an integer >= {low}, got {value!r}")
        if self.atol is not None and (isinstance(self.atol, bool)
                                      or not isinstance(self.atol, (int, float))
                                      or not self.atol > 0):
            problems.append(f"atol must be a positive number, got {self.atol!r}")
        if self.p_true_template is not None:
            try:
                p_true_template(self.p_true_template)
            except ConfigError as exc:
                problems.append(str(exc))
        if problems:
            raise ConfigError("invalid export settings: " + "; ".join(problems))

    def tolerance(self, reference_scale: float, dtype: str = "fp32") -> float:
        """The allowed max |engine - reference| for logits whose largest magnitude is given."""
        if self.atol is not None:
            return float(self.atol)
        if dtype == "fp16":
            return float(self.ATOL_FP16 + self.RTOL_FP16 * reference_scale)
        return float(self.ATOL_FP32 + self.RTOL_FP32 * reference_scale)

    def to_dict(self) -> dict:
        """The settings as recorded in the engine manifest."""
        data = asdict(self)
        data.pop("p_true_template")  # the manifest records the template in its own section
        data.pop("progress")
        data.pop("overwrite")
        return data
