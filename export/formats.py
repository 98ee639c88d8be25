"""The output formats of ``calm-export``, one object each (as the graphs are strategies).

A format says what it writes and what applies to it; nothing else in the export compares a
format's name. ``ExportConfig.format`` stays the name (the flag, the manifest), and
``ExportConfig.output`` is the object:

- ``onnx``: an engine folder around an ONNX graph (ONNX Runtime, onnxruntime-genai); the
  validated fp32 graph may become a quantised or fp16 variant, and calibration data can be
  scored on it (``--calibration-data``, ``--recalibrate``).
- ``tensorrt``: the same folder with a TensorRT plan built from the standard graph.
- ``hf``: a transformers checkpoint with the calibration folded into its LM head
  (export/checkpoint.py), for servers such as vLLM.
- ``gguf``: the source GGUF with the calibration in its head, for llama.cpp and Ollama
  (export/gguf.py): no engine folder, no torch, no validation graph.
"""

from __future__ import annotations

from dataclasses import dataclass

from calm_runtime.formats.engine import ENGINE_MANIFEST_NAME

__all__ = ["CHECKPOINT_MANIFEST", "FORMATS", "OutputFormat", "output_format"]

#: the manifest of a ``--format hf`` checkpoint (export/checkpoint.py writes it)
CHECKPOINT_MANIFEST = "calm_checkpoint.json"


@dataclass(frozen=True)
class OutputFormat:
    """One output format: what it writes and which settings apply to it."""

    name: str
    #: what the output is called in messages ("engine", "calibrated checkpoint", ...)
    what: str
    #: the file that marks an existing output of this format (``None``: a single file)
    marker: str | None
    #: an ONNX graph is built and validated (``--graph``, ``--exporter`` apply)
    onnx_graph: bool = False
    #: the fp32 ONNX graph is the engine: ``--quantize``, ``--dtype fp16`` as an ONNX variant,
    #: ``--calibration-data`` and ``--recalibrate`` apply
    onnx_engine: bool = False
    #: a TensorRT plan is built from the validated graph
    tensorrt_plan: bool = False
    #: the output is the model's own weights with the calibration folded into the head
    #: (a transformers checkpoint): the weights stay float32 and the head is untied
    checkpoint: bool = False
    #: the output is the source's GGUF file, its tensors kept as they are
    gguf_file: bool = False

    @property
    def engine_folder(self) -> bool:
        """Whether :func:`calm_export.pipeline.export_engine` builds it (a folder with a
        manifest); a GGUF file is written by :func:`calm_export.gguf.export_gguf`."""
        return not self.gguf_file

    def problems(self, config) -> list[str]:
        """What in ``config`` this format cannot honour, one sentence each with its fix."""
        problems = []
        if config.quantize is not None and not self.onnx_engine:
            problems.append(f"quantize {config.quantize} applies to --format onnx only "
                            "(TensorRT builds its own precision); drop --quantize or use "
                            "--format onnx")
        if config.calibration_data and not self.onnx_engine:
            problems.append("calibration data and --recalibrate apply to --format onnx only")
        if config.drop_shift and not self.gguf_file:
            problems.append("--drop-shift applies to --format gguf only")
        if self.checkpoint:
            if config.dtype != "fp32" or config.quantize is not None:
                problems.append("--format hf writes the model's own float32 weights; drop "
                                "--dtype/--quantize (the serving engine picks its precision)")
            if config.head_layout != "untied":
                problems.append("--format hf unties the head (the embedding must keep its "
                                "weights); drop --head-layout tied-scale")
        if self.gguf_file:
            if config.dtype != "fp32" or config.quantize is not None:
                problems.append("--format gguf keeps the source's tensors as they are (the "
                                "calibrated head at the source's type, or F16/F32); drop "
                                "--dtype/--quantize")
            elif config.head_layout != "untied" or config.graph != "auto":
                problems.append("--format gguf writes llama.cpp's own graph with an untied "
                                "head; drop --head-layout/--graph")
        return problems

    def preflight(self) -> None:
        """Fail at once, before anything heavy is loaded, when this machine cannot write the
        format (TensorRT needs its package and a GPU)."""
        if self.tensorrt_plan:
            from .tensorrt import require_tensorrt

            require_tensorrt()


FORMATS = {f.name: f for f in (
    OutputFormat("onnx", "engine", ENGINE_MANIFEST_NAME, onnx_graph=True, onnx_engine=True),
    OutputFormat("tensorrt", "engine", ENGINE_MANIFEST_NAME, onnx_graph=True, tensorrt_plan=True),
    OutputFormat("hf", "calibrated checkpoint", CHECKPOINT_MANIFEST, checkpoint=True),
    OutputFormat("gguf", "calibrated GGUF file", None, gguf_file=True),
)}


def output_format(name: str) -> OutputFormat:
    """The format called ``name`` (``ExportConfig`` has checked it is one)."""
    return FORMATS[name]
