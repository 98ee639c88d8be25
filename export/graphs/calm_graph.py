"""ONNX export of a decoder with an explicit KV cache (optimum's I/O names).

:class:`KVCacheDecoder` turns flat tensors into a transformers ``DynamicCache`` and back,
so the graph has plain inputs ``input_ids``, ``attention_mask``, ``position_ids``,
``past_key_values.{i}.key/value`` and outputs ``logits``, ``present.{i}.key/value``
(the names :func:`calm_runtime.formats.engine.engine_io_names` defines). The dynamo exporter
(``torch.export``) is the default; the TorchScript tracer is the fallback.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from calm_runtime.errors import CalmError
from calm_runtime.formats.engine import engine_io_names

__all__ = ["DecoderShape", "KVCacheDecoder", "LMHead", "OnnxExportError", "LOGITS_TO_KEEP",
           "add_logits_to_keep", "append_logits_affine", "decoder_shape", "export_onnx",
           "find_lm_head", "graph_opset"]

logger = logging.getLogger(__name__)

ONNX_FILE = "model.onnx"
EXTERNAL_DATA_FILE = "model.onnx.data"
#: the optional graph input naming how many trailing positions the LM head projects
LOGITS_TO_KEEP = "logits_to_keep"
#: ops that may sit between the head's MatMul and the ``logits`` output, position by position
_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Tanh", "Cast", "Identity"}


class OnnxExportError(CalmError):
    """Neither ONNX exporter could convert the model (the message names both failures)."""


@dataclass(frozen=True)
class DecoderShape:
    """The sizes the graph's I/O depend on."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int


def decoder_shape(config) -> DecoderShape:
    """Read the KV-cache geometry from a transformers config (text part for multimodal)."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return DecoderShape(
        num_layers=text.num_hidden_layers, num_attention_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim,
        hidden_size=text.hidden_size, vocab_size=text.vocab_size,
        max_position_embeddings=getattr(text, "max_position_embeddings", None) or 2048)


class KVCacheDecoder(nn.Module):
    """``(input_ids, attention_mask, position_ids, past) -> (logits, *present)``.

    ``past`` is a tuple ``(key_0, value_0, key_1, value_1, ...)`` of
    ``[batch, num_kv_heads, past_len, head_dim]`` tensors (``past_len`` may be 0);
    ``attention_mask`` covers past and current tokens. The logits are float32;
    ``logits_affine`` (export/fuse.py) is applied to them when the calibration cannot live
    in the head (a soft-capped family).
    """

    def __init__(self, model: nn.Module, num_layers: int,
                 logits_affine: nn.Module | None = None) -> None:
        super().__init__()
        self.model = model
        self.num_layers = num_layers
        self.logits_affine = logits_affine

    def forward(self, input_ids, attention_mask, position_ids, past):
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1])
                                             for i in range(self.num_layers)])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, cache=cache, use_cache=True)
        present = []
        for layer in out.cache.layers:
            present += [layer.keys, layer.values]
        logits = out.logits.float()
        if self.logits_affine is not None:
            logits = self.logits_affine(logits)
        return (logits, *present)


def example_inputs(shape: DecoderShape, *, batch: int = 2, seq: int = 3, past: int = 4,
                   dtype=torch.float32):
    """Inputs for tracing. Sizes are >= 2 and distinct so no dynamic axis gets specialised."""
    input_ids = torch.ones(batch, seq, dtype=torch.long)
    attention_mask = torch.ones(batch, past + seq, dtype=torch.long)
    position_ids = torch.arange(past, past + seq, dtype=torch.long).expand(batch, seq).clone()
    cache = tuple(torch.zeros(batch, shape.num_kv_heads, past, shape.head_dim, dtype=dtype)
                  for _ in range(2 * shape.num_layers))
    return input_ids, attention_mask, position_ids, cache


def export_onnx(model: nn.Module, shape: DecoderShape, directory: Path, *, opset: int = 18,
                exporter: str = "auto", external_data: bool = False,
                logits_affine: nn.Module | None = None) -> dict:
    """Export ``model`` to ``directory/model.onnx``; returns the export facts for the manifest.

    ``exporter`` is ``"dynamo"``, ``"torchscript"`` or ``"auto"`` (dynamo, then TorchScript).
    """
    wrapper = KVCacheDecoder(model, shape.num_layers, logits_affine).eval()
    path = Path(directory) / ONNX_FILE
    order = {"auto": ("dynamo", "torchscript"), "dynamo": ("dynamo",),
             "torchscript": ("torchscript",)}[exporter]
    failures = []
    for name in order:
        try:
            with torch.no_grad(), _quiet():
                if name == "dynamo":
                    _export_dynamo(wrapper, shape, path, opset, external_data)
                else:
                    _export_torchscript(wrapper, shape, path, opset, external_data)
        except Exception as exc:  # noqa: BLE001 - exporter internals raise anything
            reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            failures.append(f"{name}: {type(exc).__name__}: {reason}")
            logger.warning("the %s ONNX exporter failed (%s)%s", name, failures[-1],
                           "; trying the next one" if name != order[-1] else "")
            for leftover in Path(directory).glob(f"{ONNX_FILE}*"):
                leftover.unlink()
            continue
        logger.info("exported %s with the %s exporter", path.name, name)
        add_logits_to_keep(path, shape.vocab_size)
        import onnx

        opset = graph_opset(onnx.load(str(path), load_external_data=False), path)
        return {"exporter": name, "opset": opset, "external_data": external_data,
                "logits_to_keep": True}
    raise OnnxExportError("could not export the model to ONNX (" + " | ".join(failures) + "); "
                          "check that transformers supports torch.export for this architecture")


@dataclass(frozen=True)
class LMHead:
    """Where the LM head sits in a graph (:func:`find_lm_head`)."""

    #: the MatMul or Gemm that projects the hidden states onto the vocabulary
    node: object
    #: the initializer holding the head's weight (read directly or through weight-only ops)
    weight: str
    #: every value from the head's output to ``logits`` (their shapes hold the vocabulary)
    chain: frozenset


#: ops that only re-lay a constant weight out (a tied head reads the embedding through one)
_WEIGHT_ONLY = {"Transpose", "Cast", "Identity"}


def find_lm_head(graph, vocab_size: int) -> LMHead | None:
    """The LM head of ``graph``, found by structure, not by node names or one exporter's
    layout: walking back from ``logits`` through elementwise ops (each with exactly one input
    that depends on the graph's inputs), the first MatMul/Gemm whose first input is that
    dependent value and whose second is a constant computed from one initializer with a
    ``vocab_size`` dimension (directly, or through Transpose/Cast/Identity, as a tied head's
    embedding is read). None when the graph has no such node."""
    producer = {out: node for node in graph.node for out in node.output}
    initializers = {init.name: init for init in graph.initializer}
    inputs = {value.name for value in graph.input}

    def source(name: str, steps: int = 8):
        """The initializer a constant ``name`` is laid out from, or None."""
        while steps > 0:
            if name in initializers and name not in inputs:
                return initializers[name]
            node = producer.get(name)
            if node is None or node.op_type not in _WEIGHT_ONLY or len(node.input) != 1:
                return None
            name, steps = node.input[0], steps - 1
        return None

    def constant(name: str) -> bool:
        if name in inputs:
            return False
        if name in initializers or not name:
            return True
        node = producer.get(name)
        return node is not None and (node.op_type == "Constant" or source(name) is not None)

    name, chain = "logits", set()
    for _ in range(len(graph.node)):
        node = producer.get(name)
        if node is None:
            return None
        chain.update(node.output)
        if node.op_type in ("MatMul", "Gemm") and len(node.input) >= 2 \
                and not constant(node.input[0]):
            weight = source(node.input[1])
            if weight is not None and vocab_size in weight.dims:
                return LMHead(node=node, weight=weight.name, chain=frozenset(chain))
            return None
        if node.op_type not in _ELEMENTWISE:
            return None
        dynamic = [i for i in node.input if not constant(i)]
        if len(dynamic) != 1:
            return None
        name = dynamic[0]
    return None


def add_logits_to_keep(path: Path, vocab_size: int) -> None:
    """Give the graph an optional input ``logits_to_keep`` (int64 ``[1]``, default 0).

    A ``Slice`` before the LM head keeps the last ``logits_to_keep`` positions of the final
    hidden states (0, the default: all of them), so a prefill that needs only the last
    position never builds ``[B, S, V]``. The input is an initializer as well, which makes it
    optional: ONNX Runtime lists it among the overridable initializers, not the inputs, so
    runtimes that feed only the optimum inputs (onnxruntime-genai) run the graph unchanged.
    Only the graph proto is rewritten; external weights are left where they are.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    found = find_lm_head(graph, vocab_size)
    if found is None:
        raise OnnxExportError(f"cannot find the LM head (a MatMul of the hidden states by a "
                              f"constant [*, {vocab_size}] weight, followed by elementwise ops "
                              "only) in the exported graph; report the model type")
    head, chain = found.node, found.chain
    hidden = head.input[0]
    kept = f"{hidden}_kept"
    start, ends, axes = (f"{LOGITS_TO_KEEP}_start", f"{LOGITS_TO_KEEP}_ends",
                         f"{LOGITS_TO_KEEP}_axes")
    graph.initializer.extend([
        numpy_helper.from_array(np.zeros(1, np.int64), LOGITS_TO_KEEP),
        numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), ends),
        numpy_helper.from_array(np.ones(1, np.int64), axes)])
    graph.input.append(helper.make_tensor_value_info(LOGITS_TO_KEEP, TensorProto.INT64, [1]))
    position = list(graph.node).index(head)
    graph.node.insert(position, helper.make_node("Slice", [hidden, start, ends, axes], [kept],
                                                 name=f"{LOGITS_TO_KEEP}_slice"))
    graph.node.insert(position, helper.make_node("Neg", [LOGITS_TO_KEEP], [start],
                                                 name=f"{LOGITS_TO_KEEP}_neg"))
    head.input[0] = kept
    for value in graph.output:
        if value.name == "logits":
            value.type.tensor_type.shape.dim[1].dim_param = "logits_sequence_length"
    stale = [v for v in graph.value_info if v.name in chain]  # [B, S, V] no longer holds
    for value in stale:
        graph.value_info.remove(value)
    onnx.save_model(model, str(path))


def append_logits_affine(path: Path, scale: np.ndarray | None,
                         shift: np.ndarray | None) -> None:
    """Follow the graph's ``logits`` with ``* scale`` and ``+ shift`` (float32 ``[V]``; either
    may be ``None``): the calibration of a graph whose head calm did not build. Logits of
    another type (a float16 graph's) are cast to float32 first, so the calibration is applied
    and returned in float32. Only the graph proto is rewritten; external weights stay where
    they are."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    producer = next((n for n in graph.node if "logits" in n.output), None)
    if producer is None:
        raise OnnxExportError("the graph has no node that produces 'logits'; report the model "
                              "type")
    output = next(o for o in graph.output if o.name == "logits")
    steps = [(op, name, value) for op, name, value in
             (("Mul", "logits_calibration_scale", scale), ("Add", "logits_calibration_shift",
                                                           shift)) if value is not None]
    cast = output.type.tensor_type.elem_type != TensorProto.FLOAT
    if not steps and not cast:
        return
    current = "logits_uncalibrated"
    producer.output[list(producer.output).index("logits")] = current
    if cast:
        result = "logits" if not steps else "logits_float32"
        graph.node.append(helper.make_node("Cast", [current], [result], to=TensorProto.FLOAT,
                                           name="/logits_float32/Cast"))
        output.type.tensor_type.elem_type = TensorProto.FLOAT
        current = result
    for index, (op, name, value) in enumerate(steps):
        graph.initializer.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        result = "logits" if index == len(steps) - 1 else f"{name}_output"
        graph.node.append(helper.make_node(op, [current, name], [result], name=f"/{name}/{op}"))
        current = result
    for value in [v for v in graph.value_info if v.name == "logits"]:
        graph.value_info.remove(value)
    onnx.save_model(model, str(path))


def _dynamic_shapes(shape: DecoderShape):
    from torch.export import Dim

    batch = Dim("batch_size")
    seq = Dim("sequence_length")
    past = Dim("past_sequence_length")
    total = Dim("total_sequence_length")
    cache = tuple({0: batch, 2: past} for _ in range(2 * shape.num_layers))
    return ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq}, cache)


def _export_dynamo(wrapper, shape, path: Path, opset: int, external_data: bool) -> None:
    inputs, outputs = engine_io_names(shape.num_layers)
    program = torch.onnx.export(
        wrapper, example_inputs(shape), dynamo=True, opset_version=opset,
        dynamic_shapes=_dynamic_shapes(shape), input_names=inputs, output_names=outputs,
        optimize=True, verbose=False, report=False)
    program.save(str(path), external_data=external_data)
    names = sorted(p.name for p in path.parent.iterdir() if p.name.startswith(ONNX_FILE))
    if names not in ([ONNX_FILE], [ONNX_FILE, EXTERNAL_DATA_FILE]):
        _rewrite_external(path, external_data)  # another exporter version named files otherwise


def _export_torchscript(wrapper, shape, path: Path, opset: int, external_data: bool) -> None:
    inputs, outputs = engine_io_names(shape.num_layers)
    axes = {"input_ids": {0: "batch_size", 1: "sequence_length"},
            "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
            "position_ids": {0: "batch_size", 1: "sequence_length"},
            "logits": {0: "batch_size", 1: "sequence_length"}}
    axes.update({name: {0: "batch_size", 2: "past_sequence_length"} for name in inputs[3:]})
    axes.update({name: {0: "batch_size", 2: "total_sequence_length"} for name in outputs[1:]})
    torch.onnx.export(wrapper, example_inputs(shape), str(path), dynamo=False,
                      opset_version=opset, input_names=inputs, output_names=outputs,
                      dynamic_axes=axes, do_constant_folding=True)
    _rewrite_external(path, external_data)


def _rewrite_external(path: Path, external_data: bool) -> None:
    """Store weights in one ``model.onnx.data`` file (or inline), whatever the exporter did."""
    import onnx

    save_onnx(onnx.load(str(path), load_external_data=True), path, external_data)


def save_onnx(model, path: Path, external: bool) -> None:
    """Save an in-memory ONNX ``model`` as ``model.onnx`` (+ ``model.onnx.data`` with
    ``external``), removing any other ``model.onnx*`` file the folder held before."""
    import onnx

    for stale in Path(path).parent.glob(f"{ONNX_FILE}*"):
        stale.unlink()
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=EXTERNAL_DATA_FILE,
                        size_threshold=1024)
    else:
        onnx.save_model(model, str(path))


def graph_opset(model, path: Path) -> int:
    """The default-domain opset of a loaded graph ``model`` (read from ``path``)."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    raise OnnxExportError(f"{path} declares no default-domain opset; the export is broken")


@contextlib.contextmanager
def _quiet():
    """Silence the exporters' stdout chatter and warnings (library code only logs)."""
    sink = io.StringIO()
    noisy = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "onnxscript",
                                                  "onnx_ir")]
    levels = [lg.level for lg in noisy]
    for lg in noisy:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(noisy, levels, strict=True):
            lg.setLevel(level)
    text = sink.getvalue().strip()
    if text:
        logger.debug("exporter output:\n%s", text)


#: The ONNX Runtime contrib ops the fused graph may hold (``graph.kind`` "ort-fused"); a
#: TensorRT engine keeps the standard-op graph, which its ONNX parser reads.
FUSED_OPS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")


def fuse_graph(path: Path, shape: DecoderShape, *, external: bool) -> dict:
    """Rewrite the exported graph at ``path`` with ONNX Runtime's transformer optimizer:
    each decomposed RMSNorm (Pow, ReduceMean, Add, Sqrt, Div, Mul) becomes one
    ``SimplifiedLayerNormalization`` (``SkipSimplifiedLayerNormalization`` with the residual
    Add before it). Attention and the KV cache are left as exported. Returns what changed
    (node counts, the fused ops); the caller validates the rewritten graph like any other."""
    import collections

    import onnx
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    before = onnx.load(str(path), load_external_data=False)
    count_before = len(before.graph.node)
    del before
    options = FusionOptions("gpt2")
    for name in [k for k in vars(options) if k.startswith("enable_")]:
        setattr(options, name, False)  # RMSNorm only: attention keeps its exported form
    options.enable_layer_norm = options.enable_skip_layer_norm = True
    options.enable_shape_inference = True
    try:
        with _quiet():
            optimized = optimize_model(str(path), model_type="gpt2",
                                       num_heads=shape.num_attention_heads,
                                       hidden_size=shape.hidden_size, opt_level=0,
                                       optimization_options=options)
    except Exception as exc:  # noqa: BLE001 - the optimizer's pattern code on an unusual graph
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        logger.warning("the RMSNorm fusion failed on this graph (%s: %s); the engine keeps "
                       "the standard graph", type(exc).__name__, reason)
        return {"kind": "standard", "fused_ops": {}, "fusion_failed": reason,
                "nodes_before": count_before, "nodes": count_before}
    model = optimized.model
    domains = {n.domain for n in model.graph.node if n.domain not in ("", "ai.onnx")}
    imported = {o.domain for o in model.opset_import}
    for domain in sorted(domains - imported):  # the contrib ops' domain must be declared
        model.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    ops = collections.Counter(n.op_type for n in model.graph.node)
    fused = {op: ops[op] for op in FUSED_OPS if ops.get(op)}
    for stale in path.parent.glob(f"{ONNX_FILE}*"):
        stale.unlink()
    save_onnx(optimized.model, path, external)
    return {"kind": "ort-fused" if fused else "standard", "fused_ops": fused,
            "nodes_before": count_before, "nodes": len(optimized.model.graph.node),
            "optimizer": "onnxruntime.transformers.optimizer (RMSNorm fusions only)"}
