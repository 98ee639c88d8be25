"""ONNX Runtime backend: ``model.onnx`` on the CPU, CUDA or TensorRT execution provider.

Every step runs through IO binding: the KV cache stays where the provider put it (host
memory for the CPU, the GPU for CUDA/TensorRT) as ``OrtValue``s that are bound as the next
step's inputs, never converted to numpy; only the logits come back as a numpy array.
Running a session is thread-safe; every call builds its own binding.

Engines exported by this version take an optional input ``logits_to_keep`` (an overridable
initializer, default 0 = every position): a forward pass that needs only the last position
binds 1, so a prefill never builds ``[B, S, V]``. Older engines without it are prefilled
in chunks that bound the logits array instead.

A *packed* engine (no ``position_ids`` input: onnxruntime-genai's builder graph, whose
``GroupQueryAttention`` takes positions from the mask count) keeps its tokens at the start
of each row and one cache buffer per layer that every step reads and writes in place
(:mod:`._packed_kv`); :class:`PackedOnnxRuntimeBackend`, which the manifest of such an engine
gets, translates the runtime's left-padded calls to it.

onnxruntime-gpu silently falls back to the CPU when it cannot load CUDA; calm checks
``session.get_providers()`` after creating the session and raises instead.

Memory: ONNX Runtime's memory arena keeps what a pass allocated for the next passes (passes
of one call reuse it; without the arena, every pass page-faults its buffers anew: a
64-choice scoring call took 2.4x as long). Without more, the peak of one long prefill stayed
allocated for the life of the process. :meth:`OnnxRuntimeBackend.release`, called by the
runtime at the end of every generation and scoring call, gives the arena's free regions
back to the system (a one-token pass with the ``memory.enable_memory_arena_shrinkage`` run
option; only after a call that ran passes of several tokens). A pass whose allocation fails
raises :class:`~calm_runtime.inference.backends.BackendMemoryError` (a ``MemoryError``); the session
stays usable for the next call.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from calm_runtime.errors import ArtifactError, BackendUnavailableError, ConfigError
from calm_runtime.extras import install_hint
from calm_runtime.formats.engine import engine_io_names
from calm_runtime.inference.backends._base import Backend, BackendMemoryError, is_allocation_failure
from calm_runtime.inference.backends._packed_kv import PackedCache, pack_rows, unpack_logits

__all__ = ["OnnxRuntimeBackend", "PackedOnnxRuntimeBackend", "PROVIDER_ALIASES"]

logger = logging.getLogger(__name__)

PROVIDER_ALIASES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
}
_GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
_ONE = np.ones(1, dtype=np.int64)


def _import_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise BackendUnavailableError("onnxruntime is not installed; install calm with the cpu "
                                      f"extra ({install_hint('cpu')}) or the gpu extra "
                                      f"({install_hint('gpu')})") from None
    return onnxruntime


def normalize_providers(providers: str | Sequence | None) -> tuple[list[str], list[dict]]:
    """Provider names and options from ``"cuda"``, ``["CUDAExecutionProvider", ...]`` or
    ``[("CUDAExecutionProvider", {"device_id": 0}), ...]``; default: the CPU only."""
    if providers is None:
        providers = ["CPUExecutionProvider"]
    elif isinstance(providers, str):
        providers = [providers]
    names, options = [], []
    for entry in providers:
        opts: Mapping = {}
        if isinstance(entry, (tuple, list)) and len(entry) == 2:
            entry, opts = entry
        if not isinstance(entry, str) or not isinstance(opts, Mapping):
            raise ConfigError(f"provider {entry!r} is not a name or a (name, options) pair; pass "
                              "e.g. providers=['CUDAExecutionProvider', 'CPUExecutionProvider']")
        names.append(PROVIDER_ALIASES.get(entry.lower(), entry))
        options.append({str(k): str(v) for k, v in opts.items()})
    if not names:
        raise ConfigError("providers is empty; pass at least 'CPUExecutionProvider'")
    return names, options


class OnnxRuntimeBackend(Backend):
    """``model.onnx`` in an ONNX Runtime session: calm's own graph, which takes explicit
    positions and keeps a left-padded KV cache. Created on a packed engine's manifest, it is
    a :class:`PackedOnnxRuntimeBackend` (the builder's graph; see the module's docstring).

    Args:
        manifest: the loaded :class:`~calm_runtime.formats.engine.EngineManifest`.
        providers: execution providers in priority order (names, short names ``"cpu"``,
            ``"cuda"``, ``"tensorrt"``, or ``(name, options)`` pairs). Every requested GPU
            provider must end up active, else :class:`BackendUnavailableError`.
        threads: intra-op threads (``None``: ONNX Runtime's default, one per core).
        session_options: extra ``SessionOptions`` attributes, e.g.
            ``{"enable_cpu_mem_arena": False}`` (then :meth:`release` does nothing).
        config_entries: ``SessionOptions.add_session_config_entry`` pairs, e.g.
            ``{"session.disable_prepacking": "1"}`` (calm-export's validation).
    """

    name = "onnxruntime"
    #: largest logits array one forward pass may return when only the last position is
    #: needed (longer prompts are prefilled in chunks): 256 MiB is ~1,300 positions of a
    #: 50k vocabulary, ~250 of a 262k one
    max_logits_bytes: int = 256 << 20
    #: the graph takes explicit positions (else it is packed, see the module's docstring)
    positions: bool = True

    def __new__(cls, manifest, **_options):
        if cls is OnnxRuntimeBackend and getattr(manifest, "packed", False):
            cls = PackedOnnxRuntimeBackend
        return super().__new__(cls)

    def __init__(self, manifest, *, providers: str | Sequence | None = None,
                 threads: int | None = None, session_options: Mapping[str, Any] | None = None,
                 config_entries: Mapping[str, str] | None = None):
        ort = _import_onnxruntime()
        names, options = normalize_providers(providers)
        available = ort.get_available_providers()
        missing = [p for p in names if p not in available]
        if missing:
            raise BackendUnavailableError(
                f"execution provider(s) {missing} are not in this onnxruntime build (available: "
                f"{available}); install onnxruntime-gpu ({install_hint('gpu')}) for CUDA or "
                "pass providers=['CPUExecutionProvider']")
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise ConfigError(f"threads must be a positive integer or None, got {threads!r}")
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
        for key, value in (session_options or {}).items():
            if not hasattr(so, key):
                raise ConfigError(f"onnxruntime SessionOptions has no attribute {key!r}")
            setattr(so, key, value)
        for key, value in (config_entries or {}).items():
            so.add_session_config_entry(str(key), str(value))
        path = manifest.path("model.onnx")
        try:
            session = ort.InferenceSession(str(path), so, providers=names,
                                           provider_options=options)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own untyped errors
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            if any(p in _GPU_PROVIDERS for p in names):
                raise BackendUnavailableError(
                    f"onnxruntime cannot create a session with {names} ({reason}); check the "
                    "CUDA/cuDNN/TensorRT libraries or use the CPU provider") from None
            raise ArtifactError(f"onnxruntime cannot load {path} ({reason}); the file is "
                                "corrupted or truncated, copy the engine again or re-export "
                                "it") from None
        active = session.get_providers()
        inactive = [p for p in names if p in _GPU_PROVIDERS and p not in active]
        if inactive:
            raise BackendUnavailableError(
                f"{inactive[0]} was requested but onnxruntime runs on {active} (it falls back "
                "silently when the CUDA/cuDNN/TensorRT libraries are missing); install the "
                "libraries onnxruntime-gpu needs, or pass providers=['CPUExecutionProvider']")
        self._check_io(session, manifest, path, self.positions)
        self._session = session
        #: the graph projects only the last positions when asked (``logits_to_keep``)
        self.keeps_logits = any(i.name == "logits_to_keep"
                                for i in session.get_overridable_initializers())
        # calm's own graph holds each layer's attention matrix
        self.materializes_attention = True
        self.keeps_last_logits = (self.keeps_logits, self.keeps_logits)
        self._inputs, self._outputs = engine_io_names(manifest.num_layers,
                                                      position_ids=self.positions)
        self._past_names = self._inputs[3 if self.positions else 2:]
        past_type = next(i.type for i in session.get_inputs() if i.name == self._past_names[0])
        self._kv_dtype = _ORT_DTYPES.get(past_type, np.float32)
        self._kv_shape = (manifest.model["num_kv_heads"], manifest.model["head_dim"])
        self._vocab = manifest.vocab_size
        self.providers = active
        gpu = next((p for p in active if p in _GPU_PROVIDERS), None)
        self._device_id = 0
        if gpu is not None:
            opts = options[names.index(gpu)] if gpu in names else {}
            self._device_id = int(opts.get("device_id", 0))
        self._kv_device = "cuda" if gpu is not None else "cpu"
        self.device = f"cuda:{self._device_id}" if gpu else "cpu"
        self.description = f"onnxruntime {ort.__version__} {active[0]}"
        self._ort = ort
        # the arenas a release shrinks (the CPU's, and the GPU's when a GPU provider runs);
        # a failed shrink (no arena there) drops the GPU, then gives up
        self._shrink_targets = ["cpu:0"] + ([f"gpu:{self._device_id}"] if gpu else [])
        self._dirty = False  # a pass of several tokens ran since the last release

    @staticmethod
    def _check_io(session, manifest, path, positions: bool) -> None:
        inputs, outputs = engine_io_names(manifest.num_layers, position_ids=positions)
        got_in = [i.name for i in session.get_inputs()]
        got_out = [o.name for o in session.get_outputs()]
        if sorted(got_in) != sorted(inputs) or sorted(got_out) != sorted(outputs):
            raise ArtifactError(f"{path} has inputs {got_in[:4]}... / outputs {got_out[:3]}... "
                                "that differ from the manifest's; re-export the engine")
        # the numbers the manifest states must be the graph's where the graph fixes them
        shapes = {o.name: o.shape for o in session.get_outputs()}
        shapes.update({i.name: i.shape for i in session.get_inputs()})
        model = manifest.model
        checks = [("logits", -1, "vocab_size", model["vocab_size"])]
        if manifest.num_layers:
            checks += [("present.0.key", 1, "num_kv_heads", model["num_kv_heads"]),
                       ("present.0.key", -1, "head_dim", model["head_dim"])]
        for name, axis, key, stated in checks:
            dims = shapes.get(name) or []
            actual = dims[axis] if len(dims) >= 2 else None
            if isinstance(actual, int) and actual != stated:
                raise ArtifactError(f"{path}: the manifest's model.{key} is {stated} but the "
                                    f"graph's {name} has {actual}; re-export the engine")

    # ------------------------------------------------------------------ running
    def _empty(self, batch: int) -> list[np.ndarray]:
        empty = np.zeros((batch, self._kv_shape[0], 0, self._kv_shape[1]), self._kv_dtype)
        return [empty] * len(self._past_names)

    def run(self, input_ids, attention_mask, position_ids, state=None, *, last_only=False):
        try:
            out = self._pass(input_ids, attention_mask, position_ids, state, last_only)
            if input_ids.shape[1] > 1:
                self._dirty = True  # set when the pass ends, so that its caller's release runs
            return out
        except BackendMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - ORT raises its own untyped errors
            if not is_allocation_failure(exc):
                raise
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise BackendMemoryError(
                f"onnxruntime could not allocate the memory of a pass of "
                f"{input_ids.shape[0]} x {input_ids.shape[1]} tokens ({reason}); run fewer or "
                "shorter prompts at once or lower max_prefill_tokens") from None

    def _pass(self, input_ids, attention_mask, position_ids, state, last_only):
        if state is None:
            state = self._empty(input_ids.shape[0])
        batch, seq = input_ids.shape
        step = max(1, self.max_logits_bytes // (4 * batch * self._vocab))
        if not last_only or self.keeps_logits or seq <= step:
            return self._run(input_ids, attention_mask, position_ids, state, last_only)
        # the graph returns logits for every position: a long prompt over a large vocabulary
        # is run in chunks on top of the growing cache, keeping only the last logits
        past = attention_mask.shape[1] - seq
        for start in range(0, seq, step):
            end = min(seq, start + step)
            logits, state = self._run(input_ids[:, start:end], attention_mask[:, :past + end],
                                      position_ids[:, start:end], state, True)
        return logits, state

    def _run(self, input_ids, attention_mask, position_ids, state, last_only):
        if last_only and self.keeps_logits and input_ids.shape[1] > 1:
            return self._run_last(input_ids, attention_mask, position_ids, state)
        binding = self._session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids))
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(attention_mask))
        binding.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids))
        for name, value in zip(self._past_names, state, strict=True):
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(name, value)
            else:
                binding.bind_ortvalue_input(name, value)
        binding.bind_output("logits", "cpu")
        for name in self._outputs[1:]:
            binding.bind_output(name, self._kv_device, self._device_id)
        self._session.run_with_iobinding(binding)
        logits, *present = binding.get_outputs()
        logits = logits.numpy()
        if last_only:
            logits = logits[:, -1:]
        return logits, present

    def _run_last(self, input_ids, attention_mask, position_ids, state):
        """A multi-token pass that projects only the last position (``logits_to_keep`` = 1).

        IO binding cannot bind an overridable initializer, so this pass feeds ``OrtValue``s
        through ``run_with_ort_values``; ONNX Runtime returns its outputs in host memory,
        and on a GPU the new cache is uploaded once so that decode steps bind it in place.
        """
        ortvalue = self._ort.OrtValue.ortvalue_from_numpy
        feeds = {"input_ids": ortvalue(np.ascontiguousarray(input_ids)),
                 "attention_mask": ortvalue(np.ascontiguousarray(attention_mask)),
                 "position_ids": ortvalue(np.ascontiguousarray(position_ids)),
                 "logits_to_keep": ortvalue(_ONE)}
        for name, value in zip(self._past_names, state, strict=True):
            feeds[name] = ortvalue(value) if isinstance(value, np.ndarray) else value
        logits, *present = self._session.run_with_ort_values(self._outputs, feeds)
        if self._kv_device != "cpu":
            present = [value if value.device_name() != "cpu" else
                       ortvalue(value.numpy(), self._kv_device, self._device_id)
                       for value in present]
        return logits.numpy(), present

    def release(self) -> None:
        """Give the arena's free memory back to the system after a call's passes (a no-op
        unless a pass of several tokens ran since the last release). Buffers still held (a KV
        state alive elsewhere) keep their regions; the runtime calls this once a call's
        states are dropped."""
        if not self._dirty or not self._shrink_targets or self._session is None:
            return
        self._dirty = False
        ortvalue = self._ort.OrtValue.ortvalue_from_numpy
        one = np.ones((1, 1), dtype=np.int64)
        feeds = {"input_ids": ortvalue(one), "attention_mask": ortvalue(one)}
        if self.positions:
            feeds["position_ids"] = ortvalue(np.zeros((1, 1), dtype=np.int64))
        if self.keeps_logits:
            feeds["logits_to_keep"] = ortvalue(_ONE)
        for name, value in zip(self._past_names, self._empty(1), strict=True):
            feeds[name] = ortvalue(value)
        while self._shrink_targets:
            options = self._ort.RunOptions()
            options.add_run_config_entry("memory.enable_memory_arena_shrinkage",
                                         ";".join(self._shrink_targets))
            try:
                self._session.run_with_ort_values(self._outputs, feeds, options)
                return
            except Exception as exc:  # noqa: BLE001 - no arena there (or it is disabled)
                logger.debug("arena shrinkage on %s failed: %s", self._shrink_targets, exc)
                self._shrink_targets = self._shrink_targets[:-1]

    def assemble(self, parts, batch, width):
        out = []
        for layer in range(len(self._past_names)):
            host = [(rows, value if isinstance(value, np.ndarray) else value.numpy())
                    for rows, value in ((rows, state[layer]) for rows, state in parts)]
            first = host[0][1]
            buffer = np.zeros((batch, first.shape[1], width, first.shape[3]), first.dtype)
            for rows, value in host:
                buffer[rows, :, width - value.shape[2]:] = value
            del host
            out.append(buffer if self._kv_device == "cpu" else
                       self._ort.OrtValue.ortvalue_from_numpy(buffer, self._kv_device,
                                                              self._device_id))
        return out

    def select(self, state, rows):
        rows = np.asarray(rows, dtype=np.int64)
        if state is None:
            return None
        out = []
        for value in state:
            host = value if isinstance(value, np.ndarray) else value.numpy()
            # on the GPU a host round trip; it happens only when rows finish or fan out
            out.append(self._ort.OrtValue.ortvalue_from_numpy(
                np.ascontiguousarray(host[rows]), self._kv_device, self._device_id))
        return out

    def crop(self, state, start):
        if state is None or start <= 0:
            return state
        out = []
        for value in state:
            host = value if isinstance(value, np.ndarray) else value.numpy()
            out.append(self._ort.OrtValue.ortvalue_from_numpy(
                np.ascontiguousarray(host[:, :, start:]), self._kv_device, self._device_id))
        return out

    def close(self) -> None:
        self._session = None


class PackedOnnxRuntimeBackend(OnnxRuntimeBackend):
    """A packed engine's graph (no ``position_ids`` input: onnxruntime-genai's builder
    graph, whose ``GroupQueryAttention`` takes positions from the mask count): its tokens sit
    at the start of each row, and one cache buffer per layer is read and written in place
    (:class:`~calm_runtime.inference.backends._packed_kv.PackedCache`). The runtime's
    left-padded calls are translated to it here."""

    positions = False

    def __init__(self, manifest, **options) -> None:
        super().__init__(manifest, **options)
        # GroupQueryAttention holds no attention matrix. A packed prefill keeps one count of
        # last positions for all rows (the longest row's padding included), so only a single
        # row's is 1 wide, and a pass over a past returns every position
        self.materializes_attention = False
        self.keeps_last_logits = ("one-row" if self.keeps_logits else False, False)
        self._packed = PackedCache(self._ort, self._kv_shape, self._kv_dtype, self._kv_device,
                                   self._device_id)

    def _pass(self, input_ids, attention_mask, position_ids, state, last_only):
        batch, seq = input_ids.shape
        if state is None:  # prefill: rows packed to the left, logits moved back
            ids, mask, lengths, columns = pack_rows(input_ids, attention_mask, position_ids)
            keep = seq - int(lengths.min()) + 1 if last_only and self.keeps_logits else 0
            ortvalue = self._ort.OrtValue.ortvalue_from_numpy
            feeds = {"input_ids": ortvalue(ids), "attention_mask": ortvalue(mask)}
            if self.keeps_logits:
                feeds["logits_to_keep"] = ortvalue(np.array([keep], dtype=np.int64))
            for name, value in zip(self._past_names, self._empty(batch), strict=True):
                feeds[name] = ortvalue(value)
            logits, *present = self._session.run_with_ort_values(self._outputs, feeds)
            logits = logits.numpy()
            if last_only:
                last = lengths - 1 - (seq - logits.shape[1])
                logits = logits[np.arange(batch), last][:, None]
            else:
                logits = unpack_logits(logits, columns, seq)
            return logits, self._packed.from_present(present, lengths)
        if batch > 1 and seq > 1:  # the kernel takes several new tokens over a past only
            # for a single row: a batch goes one token at a time (decode steps)
            total = attention_mask.shape[1]
            parts = []
            for j in range(seq):
                part, state = self._pass(
                    input_ids[:, j:j + 1], attention_mask[:, :total - seq + j + 1],
                    position_ids[:, j:j + 1], state, False)
                parts.append(part)
            logits = np.concatenate(parts, axis=1)
            return (logits[:, -1:] if last_only else logits), state
        mask, real = self._packed.step_inputs(state, attention_mask, position_ids, seq)
        state = self._packed.grown(state, mask.shape[1])
        binding = state.step
        if binding is None:
            binding = self._session.io_binding()
            for name, present, value in zip(self._past_names, self._outputs[1:],
                                            state.values, strict=True):
                binding.bind_ortvalue_input(name, value)  # read and written in place
                binding.bind_ortvalue_output(present, value)
            state.step = binding
        # each step's logits land in an array of their own, which the caller keeps: no copy
        logits = np.empty((batch, seq, self._vocab), np.float32)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape),
                            logits.ctypes.data)
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids))
        binding.bind_cpu_input("attention_mask", mask)
        self._session.run_with_iobinding(binding)
        if last_only:
            logits = logits[:, -1:]
        return logits, self._packed.advance(state, real, seq)

    def assemble(self, parts, batch, width):
        (old_rows, old), *new = parts
        if new and old.arrays is not None and np.array_equal(
                old_rows, np.arange(len(old.lengths))) and all(
                rows.min() >= len(old.lengths) for rows, _ in new):
            return self._packed.append(old, new, batch)  # rows joining a running batch
        return self._packed.assemble(parts, batch)

    def compact(self, state, order):
        if state is None:
            return None
        return self._packed.compact(state, np.asarray(order, dtype=np.int64))

    def select(self, state, rows):
        if state is None:
            return None
        return self._packed.select(state, np.asarray(rows, dtype=np.int64))

    def crop(self, state, start):
        """Nothing to crop: each row's tokens sit at the start of its buffer (a packed step
        reads each row's used slots only)."""
        return state
