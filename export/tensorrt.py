"""TensorRT engine builder and runner (``calm-export --format tensorrt``).

The validated ``model.onnx`` is parsed with TensorRT's ONNX parser and built into
``model.plan`` with two optimisation profiles, then the plan is run on the same
validation cases as the ONNX graph:

* profile 0, "context": ``sequence_length`` 1..max, no past (prompt prefill);
* profile 1, "generation": ``sequence_length`` 1, past 0..max-1 (one token per step).

``fp32`` builds clear the TF32 flag (TF32 GEMMs keep only 10 mantissa bits and would
fail the fp32 tolerance); ``fp16`` builds set the FP16 flag and are checked against the
fp16 tolerance. A plan only runs on the GPU model and TensorRT version that built it,
which the manifest records. Needs ``pip install 'calm-llm[tensorrt]'`` and a CUDA GPU; without
them :func:`require_tensorrt` fails at once with one line.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import numpy as np

from calm_runtime.errors import BackendUnavailableError, ExportValidationError
from calm_runtime.formats.engine import engine_io_names

from .graphs.calm_graph import DecoderShape

__all__ = ["PLAN_FILE", "require_tensorrt", "build_plan", "tensorrt_runner"]

logger = logging.getLogger(__name__)

PLAN_FILE = "model.plan"
INSTALL_HINT = "pip install 'calm-llm[tensorrt]'"
WORKSPACE_BYTES = 4 << 30


def require_tensorrt() -> dict:
    """Fail fast unless the tensorrt package and a CUDA GPU are present; return their facts."""
    if importlib.util.find_spec("tensorrt") is None:
        raise BackendUnavailableError(f"TensorRT is not installed; install the extra with "
                                      f"{INSTALL_HINT} (needs an NVIDIA GPU with CUDA), or use "
                                      "--format onnx")
    try:
        import torch
    except ImportError:
        raise BackendUnavailableError(f"torch is not installed; TensorRT export needs torch with "
                                      f"CUDA and {INSTALL_HINT}") from None
    if not torch.cuda.is_available():
        raise BackendUnavailableError(f"no CUDA GPU is visible; TensorRT engines are built on the "
                                      f"GPU that runs them: run on a GPU machine with "
                                      f"{INSTALL_HINT}, or use --format onnx")
    import tensorrt as trt

    major, minor = torch.cuda.get_device_capability()
    return {"tensorrt_version": trt.__version__, "gpu": torch.cuda.get_device_name(),
            "compute_capability": f"{major}.{minor}"}


def _profiles(shape: DecoderShape, max_batch: int, max_total: int):
    """Per input (min, opt, max) shapes for the context and generation profiles."""
    kv, hd = shape.num_kv_heads, shape.head_dim
    opt_batch = max(1, min(max_batch, 4))
    opt_len = max(1, min(max_total, 256))
    inputs, _ = engine_io_names(shape.num_layers)
    context = {"input_ids": ((1, 1), (opt_batch, opt_len), (max_batch, max_total)),
               "attention_mask": ((1, 1), (opt_batch, opt_len), (max_batch, max_total)),
               "position_ids": ((1, 1), (opt_batch, opt_len), (max_batch, max_total))}
    generation = {"input_ids": ((1, 1), (opt_batch, 1), (max_batch, 1)),
                  "attention_mask": ((1, 1), (opt_batch, opt_len), (max_batch, max_total)),
                  "position_ids": ((1, 1), (opt_batch, 1), (max_batch, 1))}
    for name in inputs[3:]:
        context[name] = ((1, kv, 0, hd), (opt_batch, kv, 0, hd), (max_batch, kv, 0, hd))
        generation[name] = ((1, kv, 0, hd), (opt_batch, kv, opt_len - 1, hd),
                            (max_batch, kv, max_total - 1, hd))
    return [("context", context), ("generation", generation)]


def build_plan(onnx_path: Path, plan_path: Path, shape: DecoderShape, *, fp16: bool,
               max_batch: int, max_total: int) -> dict:
    """Parse ``onnx_path`` and write the serialised engine to ``plan_path``; return facts."""
    import tensorrt as trt

    trt_logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(trt_logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, trt_logger)
    if not parser.parse_from_file(str(onnx_path)):  # resolves external data next to the file
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BackendUnavailableError(f"TensorRT cannot parse {onnx_path.name} ({errors[:300]}); "
                                      "try another --opset or --format onnx")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    if hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    names = []
    for name, shapes in _profiles(shape, max_batch, max_total):
        profile = builder.create_optimization_profile()
        for tensor, (low, opt, high) in shapes.items():
            profile.set_shape(tensor, low, opt, high)
        config.add_optimization_profile(profile)
        names.append(name)
    logger.info("building the TensorRT engine (%s, profiles %s); this takes minutes",
                "fp16" if fp16 else "fp32", names)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportValidationError("TensorRT could not build an engine from the validated ONNX "
                                    "graph (see the TensorRT log above); no engine was written")
    Path(plan_path).write_bytes(bytes(serialized))
    return {"plan": Path(plan_path).name, "precision": "fp16" if fp16 else "fp32",
            "profiles": names, "max_batch_size": max_batch, "max_sequence_length": max_total,
            "tf32": False}


def tensorrt_runner(plan_path: Path, shape: DecoderShape):
    """A validation runner (same protocol as :mod:`calm_export.validate`) on a plan file."""
    import tensorrt as trt
    import torch

    trt_logger = trt.Logger(trt.Logger.WARNING)
    engine = trt.Runtime(trt_logger).deserialize_cuda_engine(Path(plan_path).read_bytes())
    if engine is None:
        raise ExportValidationError(f"TensorRT cannot load {Path(plan_path).name} that it just "
                                    "built; no engine was written")
    context = engine.create_execution_context()
    stream = torch.cuda.Stream()
    inputs, outputs = engine_io_names(shape.num_layers)
    dtypes = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16,
              trt.DataType.INT64: torch.int64, trt.DataType.INT32: torch.int32}
    placeholder = torch.zeros(1, device="cuda")  # an address for zero-sized tensors
    current = {"profile": None}

    def address(tensor):
        return tensor.data_ptr() if tensor.numel() else placeholder.data_ptr()

    def run(input_ids, attention_mask, position_ids, state):
        batch = input_ids.shape[0]
        if state is None:
            state = [torch.zeros(batch, shape.num_kv_heads, 0, shape.head_dim, device="cuda",
                                 dtype=dtypes[engine.get_tensor_dtype(inputs[3])])
                     for _ in range(2 * shape.num_layers)]
        profile = 0 if state[0].shape[2] == 0 else 1  # context: no past; generation: 1 token
        if current["profile"] != profile:
            context.set_optimization_profile_async(profile, stream.cuda_stream)
            current["profile"] = profile
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask,
                 "position_ids": position_ids}
        tensors = {}
        for name, value in feeds.items():
            tensors[name] = torch.from_numpy(np.ascontiguousarray(value)).to(
                "cuda", dtypes[engine.get_tensor_dtype(name)])
        tensors.update(zip(inputs[3:], (t.contiguous() for t in state), strict=True))
        for name in inputs:
            context.set_input_shape(name, tuple(tensors[name].shape))
            context.set_tensor_address(name, address(tensors[name]))
        results = {}
        for name in outputs:
            dims = tuple(context.get_tensor_shape(name))
            results[name] = torch.empty(dims, device="cuda",
                                        dtype=dtypes[engine.get_tensor_dtype(name)])
            context.set_tensor_address(name, address(results[name]))
        if not context.execute_async_v3(stream.cuda_stream):
            raise ExportValidationError("TensorRT failed to run the engine on a validation "
                                        "input; no engine was written")
        stream.synchronize()
        logits = results["logits"].float().cpu().numpy()
        return logits, [results[name] for name in outputs[1:]]

    return run
