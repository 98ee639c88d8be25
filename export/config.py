"""ExportConfig: every setting of ``calm-export`` in one frozen, checked dataclass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import ClassVar

from calm_runtime.data.prompts import p_true_template
from calm_runtime.errors import ConfigError
from calm_runtime.modes import CHOICE_MODES, CLOZE_VARIANTS

from .formats import FORMATS, OutputFormat, output_format
from .precision import FP32, PRECISIONS, Precision

__all__ = ["ExportConfig"]

DTYPES = ("fp32", "fp16")
QUANTIZE = ("int8", "int4")
GRAPHS = ("auto", "builder", "fused", "standard")
INT8_SCHEMES = ("blockwise", "dynamic")
INT4_BLOCKS = ("auto", "requantize")
CALIBRATION_MODES = CHOICE_MODES
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
    #: Tolerance for fp16 engines (TensorRT plans and fp16 ONNX graphs): fp16 keeps 11
    #: significant bits (~5e-4 relative per rounding) and accumulates over every layer, so
    #: logits move by ~1e-2 relative. fp16 ONNX graph of SmolLM2-135M on the CPU EP: 0.039
    #: from the fp32 graph's logits (|logits| up to 41, so the tolerance is 0.87), same top
    #: token at every position of 3 prompts.
    ATOL_FP16: ClassVar[float] = 5e-2
    RTOL_FP16: ClassVar[float] = 2e-2
    #: Above this many bytes of weights the graph keeps them in ``model.onnx.data``: a single
    #: protobuf file cannot exceed 2 GiB, and staying well below keeps loading simple.
    EXTERNAL_DATA_BYTES: ClassVar[int] = 1 << 30
    #: Modules kept fp32 per int8 scheme when ``int8_exclude`` is None. Measured on
    #: SmolLM2-135M-Instruct (onnxruntime 1.32, 496 positions; export/quantize.py has the
    #: table): blockwise int8 keeps the top token at 97.6% of positions with every MatMul
    #: quantised (the head too: keeping it fp32 gains nothing, 97.6%, and costs 81 MB and
    #: 9 ms/token); dynamic int8 needs the head, down_proj and q/k/v in fp32 to reach 91%.
    INT8_DEFAULT_EXCLUDE: ClassVar[dict[str, tuple[str, ...]]] = {
        "blockwise": (),
        "dynamic": ("lm_head", "mlp.down_proj", "self_attn.q_proj", "self_attn.k_proj",
                    "self_attn.v_proj"),
    }

    #: "onnx" (ONNX Runtime, onnxruntime-genai), "tensorrt" (needs the tensorrt extra + GPU)
    #: or "hf" (a transformers checkpoint with the calibration in its LM head, for servers
    #: such as vLLM; export/checkpoint.py says what folds), or "gguf" (the source GGUF with
    #: the calibration in its head, for llama.cpp and Ollama; export/gguf.py).
    format: str = "onnx"
    #: --format gguf: fold tau and T only and drop a per-token shift the architecture's
    #: llama.cpp graph cannot add (recorded in the file as ``calm.shift = "dropped"``).
    drop_shift: bool = False
    #: Weight and activation precision of the engine. "fp16" with ONNX (weights, activations
    #: and KV cache in float16, logits float32): the builder's graph is built from weights
    #: loaded in float16 (export/precision.py); calm's own graph is converted from its
    #: validated fp32 graph (export/quantize.py). With TensorRT: an fp16 plan.
    dtype: str = "fp32"
    #: Weight quantisation of the validated fp32 ONNX graph: ``None``, "int8" or "int4" (see
    #: export/quantize.py for the schemes and the measurements behind the defaults).
    quantize: str | None = None
    #: "blockwise": int8 weights in blocks of ``int8_block_size`` along the input dimension
    #: (MatMulNBits, int8 compute); "dynamic": ``quantize_dynamic`` (per-channel int8 weights,
    #: per-tensor uint8 activations).
    int8_scheme: str = "blockwise"
    #: Weights per quantisation block of the blockwise scheme (a power of two >= 16).
    int8_block_size: int = 32
    #: Modules whose MatMuls stay fp32: a module path ("lm_head", "model.layers.0.mlp.up_proj"),
    #: a suffix of one ("mlp.down_proj") or a glob ("model.layers.2*"). ``None``: the
    #: scheme's measured default (INT8_DEFAULT_EXCLUDE).
    int8_exclude: tuple[str, ...] | None = None
    #: The int8 engine must pick the fp32 engine's top token at this share of the drift
    #: positions, else the export fails (exclude more modules, or export fp32); 0 disables.
    int8_min_agreement: float = 0.9
    #: int4 (MatMulNBits, 4 bits, symmetric, int8 compute): weights per block along the input
    #: dimension (a power of two >= 16). Measured on SmolLM2-135M-Instruct (python
    #: benchmarks/int4_blocks.py, benchmarks/results/int4_blocks.md): blocks of 16 / 32 / 64 /
    #: 128 keep the fp32 top token at 70 / 65 / 65 / 60% of positions at 21.3 / 18.3 / 17.3 /
    #: 17.1 ms per token (fp32 38.6): 32 is as fast as the larger blocks, with the agreement
    #: of 64 and a fifth less time than 16.
    int4_block_size: int = 32
    #: "auto": when the model came from a GGUF (a packaged name, a .gguf file, or a folder
    #: `calm models install` made from one), the MatMuls whose weights are the GGUF's keep
    #: its own quantisation blocks (export/gguf_blocks.py), the rest are quantised anew;
    #: "requantize": every MatMul is quantised anew from the fp32 weights.
    int4_blocks: str = "auto"
    #: The int4 engine must pick the fp32 engine's top token at this share of the drift
    #: positions, else the export fails; lower than int8's 0.9 because 4 bits move a third of
    #: the next-token distribution on that model (mean total variation 0.32); 0 disables.
    int4_min_agreement: float = 0.6
    #: Multiple-choice data (a spec for calm_runtime.data.sets.load_dataset, e.g.
    #: "arc-easy:calibration") to report ECE on, before and after quantisation.
    calibration_data: str | None = None
    #: Refit the final temperature on the final engine's own scores of ``calibration_data``
    #: (letter mode: token-level T folded into the head; cloze: ``answer_temperature``).
    recalibrate: bool = False
    #: "cloze" or "letter" (docs/methods.md §2); ``None``: the adapter's fit mode, else "cloze".
    calibration_mode: str | None = None
    #: Cloze score variant; ``None``: the adapter's recorded variant, else "mean" (the
    #: training default).
    calibration_variant: str | None = None
    #: Use only the first ``calibration_limit`` records of ``calibration_data``.
    calibration_limit: int | None = None
    #: Bins of the reported ECE.
    n_bins: int = 10
    #: ONNX opset of the exported graph.
    opset: int = 18
    #: How calm's own graph is exported: "dynamo" (torch.export), "torchscript" (legacy
    #: tracer) or "auto" (dynamo, then the TorchScript exporter if dynamo fails; the engine
    #: is validated either way). Naming one also selects calm's own graph under --graph auto.
    exporter: str = "auto"
    #: "untied": a tied embedding is copied and the head becomes ``W/(tau T) h + b'`` (one
    #: MatMul + Add). "tied-scale": the tie is kept and the head's MatMul is followed by an
    #: elementwise scale and shift. See export/fuse.py for the measurement behind the default.
    head_layout: str = "untied"
    #: "builder": onnxruntime-genai's model builder graph with the calibration in its head
    #: (export/graphs/genai_builder.py; GroupQueryAttention, an in-place KV cache); "fused":
    #: calm's own graph (torch.export) with its RMSNorms as ONNX Runtime's fused normalisation
    #: ops (export/graphs/calm_graph.py ``fuse_graph``); "standard": calm's graph in standard
    #: ONNX ops only.
    #: "auto": "builder" for the families and settings it covers, else "fused" (and
    #: "fused" when the builder fails or its graph does not pass validation). TensorRT
    #: engines are always built from the standard graph (its parser does not read ONNX
    #: Runtime's contrib ops).
    graph: str = "auto"
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
    #: Where the engine is validated: "cpu" (ONNX Runtime's CPU provider), "cuda"/"cuda:N"
    #: (its CUDA provider, the CPU for ops it lacks) or "auto" (CUDA when onnxruntime-gpu
    #: offers it). The torch reference runs on the CPU: a few prompts, float32.
    device: str = "auto"

    def __post_init__(self) -> None:
        problems = []
        from calm_runtime.placement import check_device

        try:
            check_device(self.device)
        except ConfigError as exc:
            problems.append(str(exc).split(";")[0])
        output = FORMATS.get(self.format)  # None: an unknown name, refused here
        if output is None:
            problems.append(f"format must be one of {list(FORMATS)}, got {self.format!r}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.quantize is not None:
            if self.quantize not in QUANTIZE:
                problems.append(f"quantize must be one of {list(QUANTIZE)} or None, got "
                                f"{self.quantize!r}")
            elif self.dtype != "fp32" and output is not None and output.onnx_engine:
                problems.append(f"quantize {self.quantize} starts from the fp32 graph; use "
                                f"--dtype fp32 with --quantize {self.quantize}")
        if not isinstance(self.drop_shift, bool):
            problems.append(f"drop_shift must be true or false, got {self.drop_shift!r}")
        elif output is not None:
            problems += output.problems(self)
        problems += self._variant_problems()
        if isinstance(self.opset, bool) or not isinstance(self.opset, int) \
                or not 14 <= self.opset <= 23:
            problems.append(f"opset must be an integer in [14, 23], got {self.opset!r}")
        if self.graph not in GRAPHS:
            problems.append(f"graph must be one of {list(GRAPHS)}, got {self.graph!r}")
        elif self.graph == "builder" and output is not None and output.engine_folder:
            from .graphs.builder import settings_problem

            problem = settings_problem(self)
            if problem is not None:
                problems.append(f"--graph builder cannot build this engine: {problem}; use "
                                "--graph auto")
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

    def _variant_problems(self) -> list[str]:
        problems = []
        if self.int8_scheme not in INT8_SCHEMES:
            problems.append(f"int8_scheme must be one of {list(INT8_SCHEMES)}, got "
                            f"{self.int8_scheme!r}")
        size = self.int8_block_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 16 or size & (size - 1):
            problems.append(f"int8_block_size must be a power of two >= 16, got {size!r}")
        exclude = self.int8_exclude
        if exclude is not None and (isinstance(exclude, str) or not all(
                isinstance(p, str) and p for p in exclude)):
            problems.append(f"int8_exclude must be a list of module names, got {exclude!r}")
        for name in ("int8_min_agreement", "int4_min_agreement"):
            agreement = getattr(self, name)
            if isinstance(agreement, bool) or not isinstance(agreement, (int, float)) \
                    or not 0 <= agreement <= 1:
                problems.append(f"{name} must be in [0, 1], got {agreement!r}")
        if self.int4_blocks not in INT4_BLOCKS:
            problems.append(f"int4_blocks must be one of {list(INT4_BLOCKS)}, got "
                            f"{self.int4_blocks!r}")
        size = self.int4_block_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 16 or size & (size - 1):
            problems.append(f"int4_block_size must be a power of two >= 16, got {size!r}")
        if self.recalibrate and not self.calibration_data:
            problems.append("recalibrate needs calibration data; pass --recalibrate DATA")
        if self.calibration_data is not None and (not isinstance(self.calibration_data, str)
                                                  or not self.calibration_data):
            problems.append(f"calibration_data must be a data spec string, got "
                            f"{self.calibration_data!r}")
        if self.calibration_mode not in (None, *CALIBRATION_MODES):
            problems.append(f"calibration_mode must be one of {list(CALIBRATION_MODES)}, got "
                            f"{self.calibration_mode!r}")
        if self.calibration_variant not in (None, *CLOZE_VARIANTS):
            problems.append(f"calibration_variant must be one of {list(CLOZE_VARIANTS)}, got "
                            f"{self.calibration_variant!r}")
        for name, low in (("calibration_limit", 2), ("n_bins", 1)):
            value = getattr(self, name)
            if value is None and name == "calibration_limit":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                problems.append(f"{name} must be an integer >= {low}, got {value!r}")
        return problems

    @property
    def output(self) -> OutputFormat:
        """The output format's object (export/formats.py): what it writes, what applies."""
        return output_format(self.format)

    @property
    def precision(self) -> Precision:
        """The ONNX engine's precision (export/precision.py): ``--quantize``'s, else
        ``--dtype``'s; fp32 for the outputs that are no ONNX engine (a TensorRT plan reads
        ``dtype`` itself)."""
        if not self.output.onnx_engine:
            return FP32
        return PRECISIONS[self.quantize or self.dtype]

    def int8_excluded_modules(self) -> tuple[str, ...]:
        """``int8_exclude``, or the scheme's measured default when it is ``None``."""
        if self.int8_exclude is not None:
            return tuple(self.int8_exclude)
        return self.INT8_DEFAULT_EXCLUDE[self.int8_scheme]

    @property
    def providers(self) -> list[str] | None:
        """ONNX Runtime providers the engine is validated on (``None``: calm's default, the
        CPU)."""
        device = self.device
        if device == "auto":
            import importlib.util

            if importlib.util.find_spec("onnxruntime") is None:
                return None
            import onnxruntime

            device = ("cuda" if "CUDAExecutionProvider" in onnxruntime.get_available_providers()
                      else "cpu")
        return ["cuda", "cpu"] if device.startswith("cuda") else None

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
        data.pop("drop_shift")  # --format gguf only; its files record it as calm.shift
        return data
