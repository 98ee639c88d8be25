"""TensorRT backend: the ``model.plan`` of an engine exported with ``--format tensorrt``.

The plan has two optimisation profiles (see ``calm_export.tensorrt``): 0 "context" (any
number of tokens, no past) and 1 "generation" (one token on top of a past). A forward
pass with a past and several tokens (cloze continuations) is therefore run one token at a
time. Batches are limited to the plan's ``max_batch_size``. CUDA buffers are torch
tensors; an execution context is not thread-safe, so each call borrows one from a small
pool (created on demand, guarded by a lock).

Needs ``pip install 'calm-llm[tensorrt]'``, torch with CUDA and the GPU the plan was built on;
otherwise :class:`BackendUnavailableError` says which is missing.
"""

from __future__ import annotations

import importlib.util
import threading

import numpy as np

from calm_runtime.errors import ArtifactError, BackendUnavailableError, ConfigError
from calm_runtime.formats.engine import engine_io_names
from calm_runtime.inference.backends._base import Backend, TorchStateMixin

__all__ = ["TensorRTBackend"]

_HINT = "pip install 'calm-llm[tensorrt]' on a machine with an NVIDIA GPU"


class TensorRTBackend(TorchStateMixin, Backend):
    """``model.plan`` run with the TensorRT Python API on one CUDA device."""

    name = "tensorrt"
    multi_token_with_past = False
    #: its activation memory is the plan's, sized by its profiles when it was built: the
    #: prefill budget only caps the tokens of a pass (and a prompt over it is refused, since
    #: a plan cannot prefill in pieces)
    materializes_attention = False
    keeps_last_logits = (True, True)

    def __init__(self, manifest, *, device: int = 0):
        if manifest.kind != "tensorrt":
            raise BackendUnavailableError(
                f"engine {manifest.root} is kind {manifest.kind!r} (no TensorRT plan); re-export "
                "it with calm-export --format tensorrt, or run it with backend='onnxruntime' and "
                "providers=['TensorrtExecutionProvider', 'CUDAExecutionProvider']")
        if importlib.util.find_spec("tensorrt") is None:
            raise BackendUnavailableError(f"TensorRT is not installed; {_HINT}")
        try:
            import torch
        except ImportError:
            raise BackendUnavailableError("the TensorRT backend keeps its CUDA buffers in torch "
                                          "tensors; install torch with CUDA") from None
        if not torch.cuda.is_available():
            raise BackendUnavailableError(f"no CUDA GPU is visible; TensorRT needs one ({_HINT})")
        import tensorrt as trt

        self._torch, self._trt = torch, trt
        self._device = torch.device("cuda", device)
        plan = manifest.model_path
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        with torch.cuda.device(self._device):
            engine = runtime.deserialize_cuda_engine(plan.read_bytes())
        if engine is None:
            raise BackendUnavailableError(
                f"TensorRT {trt.__version__} cannot load {plan.name}; a plan only runs on the GPU "
                "model and TensorRT version that built it, re-export on this machine")
        self._engine = engine
        settings = manifest.export.get("tensorrt") or {}
        self.max_batch = int(settings.get("max_batch_size") or 8)
        self._max_total = int(settings.get("max_sequence_length") or
                              manifest.model["max_position_embeddings"])
        self._inputs, self._outputs = engine_io_names(manifest.num_layers)
        missing = [n for n in self._inputs + self._outputs
                   if n not in {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}]
        if missing:
            raise ArtifactError(f"{plan.name} lacks tensors {missing[:3]}; re-export the engine")
        self._dtypes = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16,
                        trt.DataType.INT64: torch.int64, trt.DataType.INT32: torch.int32}
        self._kv = (manifest.model["num_kv_heads"], manifest.model["head_dim"])
        self._kv_dtype = self._dtypes[engine.get_tensor_dtype(self._inputs[3])]
        self._placeholder = torch.zeros(1, device=self._device)
        self._pool: list = []
        self._lock = threading.Lock()
        self.device = str(self._device)
        self.description = (f"tensorrt {trt.__version__} {torch.cuda.get_device_name(device)} "
                            f"({settings.get('precision', manifest.model['dtype'])})")

    # ------------------------------------------------------------------ contexts
    def _borrow(self):
        with self._lock:
            if self._pool:
                return self._pool.pop()
        context = self._engine.create_execution_context()
        stream = self._torch.cuda.Stream(device=self._device)
        return [context, stream, None]

    def _give_back(self, slot) -> None:
        with self._lock:
            self._pool.append(slot)

    # ------------------------------------------------------------------ running
    def run(self, input_ids, attention_mask, position_ids, state=None, *, last_only=False):
        torch = self._torch
        batch, seq = input_ids.shape
        if batch > self.max_batch:
            raise ConfigError(f"batch of {batch} rows exceeds the TensorRT plan's max_batch_size "
                              f"{self.max_batch}; use smaller batches or re-export with a larger "
                              "--max-batch-size")
        if attention_mask.shape[1] > self._max_total:
            raise ConfigError(f"sequence of {attention_mask.shape[1]} tokens exceeds the plan's "
                              f"max_sequence_length {self._max_total}; re-export with a larger one")
        if state is None:
            empty = torch.zeros(batch, self._kv[0], 0, self._kv[1], device=self._device,
                                dtype=self._kv_dtype)
            state = [empty] * len(self._inputs[3:])
        past = state[0].shape[2]
        if past == 0 or seq == 1:
            return self._forward(input_ids, attention_mask, position_ids, state, last_only)
        pieces = []  # profile 1 takes one token on top of a past: step through
        for t in range(seq):
            mask = attention_mask[:, :past + t + 1]
            logits, state = self._forward(input_ids[:, t:t + 1], mask,
                                          position_ids[:, t:t + 1], state, False)
            pieces.append(logits)
        logits = np.concatenate(pieces, axis=1)
        return (logits[:, -1:] if last_only else logits), state

    def _forward(self, input_ids, attention_mask, position_ids, state, last_only):
        torch = self._torch
        slot = self._borrow()
        context, stream, _ = slot
        try:
            with torch.cuda.stream(stream):  # allocations and copies ordered with TensorRT
                results = self._execute(context, stream, slot, input_ids, attention_mask,
                                        position_ids, state)
        finally:
            self._give_back(slot)
        logits = results["logits"]
        if last_only:
            logits = logits[:, -1:]
        return logits.float().cpu().numpy(), [results[n] for n in self._outputs[1:]]

    def _execute(self, context, stream, slot, input_ids, attention_mask, position_ids, state):
        torch = self._torch
        profile = 0 if state[0].shape[2] == 0 else 1
        if slot[2] != profile:
            context.set_optimization_profile_async(profile, stream.cuda_stream)
            slot[2] = profile
        tensors = {}
        for name, value in (("input_ids", input_ids), ("attention_mask", attention_mask),
                            ("position_ids", position_ids)):
            dtype = self._dtypes[self._engine.get_tensor_dtype(name)]
            tensors[name] = torch.from_numpy(np.ascontiguousarray(value)).to(self._device, dtype)
        tensors.update(zip(self._inputs[3:], (t.contiguous() for t in state), strict=True))
        for name in self._inputs:
            context.set_input_shape(name, tuple(tensors[name].shape))
            context.set_tensor_address(name, self._address(tensors[name]))
        results = {}
        for name in self._outputs:
            dims = tuple(context.get_tensor_shape(name))
            results[name] = torch.empty(dims, device=self._device,
                                        dtype=self._dtypes[self._engine.get_tensor_dtype(name)])
            context.set_tensor_address(name, self._address(results[name]))
        if not context.execute_async_v3(stream.cuda_stream):
            raise BackendUnavailableError("TensorRT failed to run the plan; check the GPU and "
                                          "the input sizes")
        stream.synchronize()
        return results

    def _address(self, tensor) -> int:
        return tensor.data_ptr() if tensor.numel() else self._placeholder.data_ptr()

    def close(self) -> None:
        with self._lock:
            self._pool.clear()
        self._engine = None
