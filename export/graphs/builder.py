"""onnxruntime-genai's model builder graph with the calibration in its head
(``--graph builder``, ``genai-builder``; the graph itself is genai_builder.py).

Where it can build is decided here only: by the settings (:func:`settings_problem`, which
``ExportConfig`` asks under ``--graph builder``), then by the model's family and the
installed onnxruntime-genai release."""

from __future__ import annotations

import importlib.util

from calm_runtime.errors import ExportValidationError

from .base import GraphStrategy

__all__ = ["BUILDER_FAMILIES", "BuilderGraph", "settings_problem"]

#: model types whose builder graph passes calm's conformance matrix (tests/calm_export/
#: test_conformance.py); OLMo-2, Cohere and GPT-NeoX are not built by onnxruntime-genai.
BUILDER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "gemma2",
                    "gemma3_text")


def settings_problem(config) -> str | None:
    """Why the export settings alone rule the builder's graph out (``None``: they do not)."""
    if config.output.tensorrt_plan:
        return "TensorRT's parser reads standard ONNX ops only"
    if not config.output.onnx_engine:
        return f"--format {config.format} writes no ONNX graph"
    if config.precision.variant and not config.precision.quantized \
            and config.precision.builder is None:
        return f"the {config.precision} variant converts calm's standard graph"
    if config.head_layout != "untied":
        return "--head-layout tied-scale keeps calm's own head"
    if config.exporter != "auto":
        return f"--exporter {config.exporter} exports calm's own graph"
    return None


class BuilderGraph(GraphStrategy):
    name = "builder"
    fallible = True

    @property
    def failures(self):
        from .genai_builder import BuilderError

        return (BuilderError, ExportValidationError)

    def unsupported_because(self, config, model_config=None) -> str | None:
        problem = settings_problem(config)
        if problem is not None or model_config is None:
            return problem
        model_type = getattr(model_config.get_text_config(decoder=True), "model_type", None)
        if model_type not in BUILDER_FAMILIES:
            return f"onnxruntime-genai's builder does not build {model_type} models"
        window = getattr(model_config, "sliding_window", None)
        if model_type == "mistral" and window:
            # measured: the builder's Mistral graph attends past the window (tiny model,
            # window 8)
            return "the builder's Mistral graph does not apply a sliding window"
        if importlib.util.find_spec("onnxruntime_genai") is None:
            return "onnxruntime-genai is not installed (pip install 'calm-llm[genai]')"
        from .genai_build import version_problem

        return version_problem()

    def build(self, job) -> dict:
        from . import genai_builder

        return genai_builder.build_graph(job.take_model(), job.tokenizer, job.staging,
                                         job.shape.vocab_size, affine=job.affine,
                                         source_dtype=job.source_dtype,
                                         precision=job.builder_precision)
