"""The ``genai-builder`` graph: onnxruntime-genai's model builder, calibrated.

For the families its builder covers, calm-export's default graph is the builder's
(``--graph auto``): GroupQueryAttention with the rotary embedding inside, packed q/k/v,
SkipSimplifiedLayerNormalization, one KV buffer per layer that a step writes in place
(benchmarks/results/engines.md has the speeds). calm hands the builder the merged model
whose LM head already computes the calibrated logits, so nothing in the builder's graph
changes but the head's weights:

* tau and T fold into the head's rows ``W / (tau T)`` (the head is untied from the
  embedding first, export/fuse.py), a family's logit scaling too (export/heads.py);
* where tau is one number and the source head is tied (a temperature fit, or no adapter),
  the tie is kept and ``* 1/(tau T)`` (and the shift) follow the shared head, so the
  engine is no larger than the builder's own (``fuse.keeps_tied_head``);
* the shift ``(b / tau + l) / T`` (the head's bias after fusing) is not in the builder's
  head: it is an ``Add`` after the head's ``MatMul``, omitted when zero;
* after a non-linear head (Gemma-2's soft-capping) the calibration is ``Mul`` + ``Add`` on
  the finished logits, as in calm's own graph;
* ``logits_to_keep`` is added as in calm's own graph (export/graphs/calm_graph.py).

Sliding-window layers keep full-length caches (``windowed_kv_cache=false``; the attention
masks the window itself), so every layer's cache has the same layout for calm's runtime.
The graph has no ``position_ids`` input: its rows are packed to the left, which calm's
runtime does (calm_runtime/inference/backends/_packed_kv.py) and onnxruntime-genai does natively.
It uses ONNX Runtime contrib ops, so ``--format tensorrt`` builds from calm's standard
graph, and ``--quantize fp16`` too (int8/int4 quantise this graph's MatMuls).

The engine is validated like every other (export/validate.py, through calm's runtime
backend). Where the builder fails, or its graph does not pass, ``--graph auto`` exports
calm's own graph instead and says why (export/graphs/: where the builder can build is
decided in graphs/builder.py). calm drives only the builder releases it is tested
with (``BUILDER_VERSIONS`` in graphs/genai_build.py, pinned by the ``genai`` extra): with
another, ``--graph auto`` takes calm's own graph and records why, ``--graph builder`` is a
one-line error; the manifest's ``export.graph.builder_version`` names the release used.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections import Counter
from pathlib import Path

import numpy as np

from calm_runtime.errors import CalmError
from calm_runtime.placement import return_free_memory

from . import genai_build
from .calm_graph import (
    EXTERNAL_DATA_FILE,
    ONNX_FILE,
    add_logits_to_keep,
    append_logits_affine,
    graph_opset,
)

__all__ = ["GENAI_CONFIG", "GRAPH_KIND", "BuilderError", "build_graph"]

logger = logging.getLogger(__name__)

#: onnxruntime-genai's config file, which the builder writes and export/engine_writer.py
#: writes for calm's own graph
GENAI_CONFIG = "genai_config.json"
#: ``export.graph.kind`` of onnxruntime-genai's builder graph (packed I/O, no position_ids)
GRAPH_KIND = "genai-builder"


class BuilderError(CalmError):
    """onnxruntime-genai's builder did not produce a graph."""


def build_graph(model_box: list, tokenizer, staging: Path, vocab_size: int, *,
                affine=None, source_dtype: str | None = None, precision: str = "fp32") -> dict:
    """Write the calibrated builder graph (``model.onnx`` + ``model.onnx.data``) and the
    builder's ``genai_config.json`` into ``staging``; returns the export facts.

    ``model_box`` holds (``[model]``) the merged model with the calibration fused into its
    head (its bias, the shift, is moved after the head here), or, with ``affine`` (a
    :class:`~calm_export.fuse.LogitsAffine`), the model whose finished logits get it. The
    model is taken out of the box, written to a staging folder and dropped before the
    builder reads that folder: the process never holds two copies of the weights. Where every
    weight is exactly a ``source_dtype`` number (the checkpoint's own precision: nothing but
    an exact upcast was done to them, as with no LoRA and the calibration after the head or
    none), the folder is written in that precision, so the builder's mapped copy is as small
    as the checkpoint's; the graph's weights are the same numbers either way.

    ``precision`` is the builder's: "fp16" (a model loaded in float16) writes float16
    weights, activations and KV cache; its logits are cast to float32 before the
    calibration's ops, so an engine's logits are float32 in every precision.
    """
    work = staging / ".builder"
    source, output, cache = work / "source", work / "output", work / "cache"
    try:
        scale, shift = _write_source(model_box, tokenizer, source, affine, source_dtype)
        return_free_memory()
        _run_builder(source, output, cache, work / "builder.log", precision)
        return_free_memory()
        path = output / ONNX_FILE
        if precision != "fp32":
            _drop_value_info(path)
        if scale is not None or shift is not None or precision != "fp32":
            append_logits_affine(path, scale, shift)
        add_logits_to_keep(path, vocab_size)
        for name in (ONNX_FILE, EXTERNAL_DATA_FILE, GENAI_CONFIG):
            if (output / name).is_file():
                shutil.move(str(output / name), str(staging / name))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    import onnx
    import onnxruntime_genai

    graph = onnx.load(str(staging / ONNX_FILE), load_external_data=False)
    ops = Counter(node.op_type for node in graph.graph.node)
    opset = graph_opset(graph, staging / ONNX_FILE)
    version = str(onnxruntime_genai.__version__)
    return {"exporter": f"onnxruntime-genai {version} model builder"
                        + (f" (-p {precision})" if precision != "fp32" else ""),
            "opset": opset, "external_data": (staging / EXTERNAL_DATA_FILE).is_file(),
            "logits_to_keep": True,
            "graph": {"kind": GRAPH_KIND, "builder_version": version,
                      # rows packed to the left, no position_ids (GroupQueryAttention); the
                      # float16 CPU graph takes positions (MultiHeadAttention)
                      "packed": "position_ids" not in {i.name for i in graph.graph.input},
                      "fused_ops": {
                op: ops[op] for op in ("GroupQueryAttention", "SkipSimplifiedLayerNormalization",
                                       "SimplifiedLayerNormalization") if ops[op]},
                "calibration_after_head": [n for n, v in (("scale", scale), ("shift", shift))
                                           if v is not None]}}


def _drop_value_info(path: Path) -> None:
    """Remove the graph's intermediate shape annotations. The builder's float16 CPU graph
    (MultiHeadAttention, not GroupQueryAttention) names the key/value repeat's length
    ``sequence_length`` where it is the total length, and ONNX Runtime then reuses a
    buffer of the wrong size in the first decode step; its kernels need no annotations."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    del model.graph.value_info[:]
    onnx.save_model(model, str(path))


def _write_source(model_box: list, tokenizer, source: Path, affine, source_dtype=None):
    """The model (popped from ``model_box``) saved into ``source`` for the builder, with its
    head's bias left out; returns the ``(scale, shift)`` to append after the head."""
    model = model_box.pop()
    scale = shift = None
    head = model.get_output_embeddings()
    if affine is not None:
        if affine.center:
            raise BuilderError("a centred adapter after a soft-capped head needs a mean over "
                               "the vocabulary, which the builder graph's appended ops lack; "
                               "export with --graph fused")
        scale, shift = affine.scale.detach().numpy(), affine.shift.detach().numpy()
    elif getattr(head, "bias", None) is not None:
        shift = head.bias.detach().float().numpy().copy()
        head.bias = None  # the builder's head has none: the shift is grafted after it
    if source_dtype is not None and _narrow_exactly(model, source_dtype):
        logger.info("the builder reads the weights in the checkpoint's %s (every weight is "
                    "exactly one)", source_dtype)
    if scale is not None and np.all(scale == 1.0):
        scale = None
    if shift is not None and not np.any(shift):
        shift = None
    model.save_pretrained(str(source))
    tokenizer.save_pretrained(str(source))
    return scale, shift


def _narrow_exactly(model, dtype: str) -> bool:
    """Cast ``model``'s floating parameters to ``dtype`` in place (one tensor at a time) when
    every one of them survives the round trip exactly; ``False`` (nothing changed) else."""
    import torch

    target = getattr(torch, dtype, None)
    if not isinstance(target, torch.dtype) or not target.is_floating_point:
        return False
    params = [p for p in {id(p): p for p in model.parameters()}.values()
              if p.is_floating_point() and p.dtype.itemsize > target.itemsize]
    if not params:
        return False
    with torch.no_grad():
        for param in params:
            if not torch.equal(param.to(target).to(param.dtype), param):
                return False
        for param in params:
            param.data = param.data.to(target)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.dtype = target
    return True


def _drop_handlers_on(stream) -> None:
    """Remove the logging handlers that the builder's libraries attached while stdout and
    stderr pointed at ``stream`` (about to be closed): later log records would fail."""
    import logging

    loggers = [logging.getLogger(), *(logger for logger in
                                      logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    for logger in loggers:
        for handler in list(logger.handlers):
            if getattr(handler, "stream", None) is stream:
                logger.removeHandler(handler)


def _run_builder(source: Path, output: Path, cache: Path, log: Path,
                 precision: str = "fp32") -> None:
    """The builder in this process (torch and transformers are loaded already), its prints
    and progress bars into ``log``."""
    args = [str(source), str(output), str(cache), precision, "windowed_kv_cache=false"]
    with open(log, "w", encoding="utf-8") as sink, contextlib.redirect_stdout(sink), \
            contextlib.redirect_stderr(sink):
        try:
            genai_build.main(args)
        except Exception as exc:  # noqa: BLE001 - the builder raises its own untyped errors
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise BuilderError(f"onnxruntime-genai's builder failed ({type(exc).__name__}: "
                               f"{reason})") from None
        finally:
            _drop_handlers_on(sink)
    if not (output / ONNX_FILE).is_file():
        raise BuilderError("onnxruntime-genai's builder wrote no model.onnx")
