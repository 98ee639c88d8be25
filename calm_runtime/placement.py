"""Where a model's weights live and in which precision: ``--dtype`` and ``--device``.

Every command that loads a transformers model (``calm fit``, ``calm eval``, ``calm score
--backend torch``, ``calm train``, ``calm-export``) takes the same two settings, resolved
once here into a :class:`Placement`:

* ``dtype``: ``auto`` (the checkpoint's own ``torch_dtype``/``dtype``; float32 where the
  device cannot compute that half type, or where the checkpoint names none), ``float32``,
  ``bfloat16`` or ``float16`` (``fp32``/``bf16``/``fp16`` are accepted too);
* ``device``: ``auto`` (the first CUDA device when torch sees one, else the CPU), ``cpu``,
  ``cuda`` or ``cuda:N``.

Scores are always read in float32: the logits are cast before any softmax, so a bfloat16
model's scores are the bfloat16 model's logits, computed soundly. An adapter records the
placement it was fitted at (``provenance.placement``), and the score cache keys on it, so
float32 and bfloat16 scores never mix. torch is imported only when a placement is resolved.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from calm_runtime.errors import BackendUnavailableError, ConfigError

__all__ = ["DTYPES", "DEVICE_FORMS", "Placement", "check_dtype", "check_device",
           "checkpoint_dtype", "add_placement_arguments", "read_converted", "place_on",
           "return_free_memory"]

logger = logging.getLogger(__name__)

#: ``--dtype`` choices, in torch's names
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: the short names users bring from optimum (``fp16``) and llama.cpp-style tools
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
            "float": "float32"}
#: what ``--device`` may say
DEVICE_FORMS = "auto, cpu, cuda or cuda:N"
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
#: bytes per weight of each dtype
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def check_dtype(value: str) -> str:
    """``value`` in torch's spelling (aliases resolved); one-line :class:`ConfigError` else."""
    name = _ALIASES.get(str(value).lower(), str(value).lower())
    if name not in DTYPES:
        raise ConfigError(f"dtype {value!r} is not one of {', '.join(DTYPES)} (or fp32, bf16, "
                          "fp16); pass --dtype auto to use the checkpoint's own")
    return name


def check_device(value: str) -> str:
    """``value`` if it is a device calm places models on; one-line :class:`ConfigError` else."""
    text = str(value).lower()
    if not _DEVICE.fullmatch(text):
        raise ConfigError(f"device {value!r} is not one of {DEVICE_FORMS}; pass --device cpu "
                          "or --device cuda")
    return text


def checkpoint_dtype(folder: str | Path) -> str | None:
    """The dtype a transformers folder's ``config.json`` says its weights are in
    (``dtype``, or ``torch_dtype`` before transformers 5), or ``None``."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("dtype") or config.get("torch_dtype")
    if value is None and isinstance(config.get("text_config"), dict):
        text = config["text_config"]
        value = text.get("dtype") or text.get("torch_dtype")
    value = _ALIASES.get(str(value).lower(), str(value).lower()) if value else None
    return value if value in DTYPE_BYTES else None


@dataclass(frozen=True)
class Placement:
    """A model's dtype and device, as asked for (``auto`` allowed) or resolved."""

    dtype: str = "auto"
    device: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", check_dtype(self.dtype))
        object.__setattr__(self, "device", check_device(self.device))

    @property
    def resolved(self) -> bool:
        return self.dtype != "auto" and self.device != "auto"

    @property
    def default(self) -> bool:
        """float32 on the CPU: what calm ran before there was a choice."""
        return self.dtype == "float32" and self.device == "cpu"

    def resolve(self, folder: str | Path | None = None) -> Placement:
        """This placement with ``auto`` settled: the device first (CUDA when torch sees it),
        then the dtype (the checkpoint's in ``folder``, if the device computes it). A CUDA
        device that is not there is one line naming it."""
        device = self.device
        if device == "auto" or device.startswith("cuda"):
            torch = _torch()
            available = torch.cuda.is_available()
            if device == "auto":
                device = "cuda" if available else "cpu"
            elif not available:
                raise BackendUnavailableError(f"--device {device}: torch sees no CUDA device "
                                              "(a CPU build of torch, or no GPU); pass "
                                              "--device cpu")
            elif ":" in device and int(device.split(":")[1]) >= torch.cuda.device_count():
                raise BackendUnavailableError(
                    f"--device {device}: torch sees {torch.cuda.device_count()} CUDA "
                    f"device(s); pass cuda:0 to cuda:{torch.cuda.device_count() - 1}")
        dtype = self.dtype
        if dtype == "auto":
            own = checkpoint_dtype(folder) if folder is not None else None
            dtype = own if own is not None and computes(own, device) else "float32"
            if own is not None and own != dtype:
                logger.info("the checkpoint is %s, which %s does not compute: loading it as "
                            "float32", own, device)
        elif not computes(dtype, device):
            raise BackendUnavailableError(f"--dtype {dtype} cannot be computed on {device} by "
                                          "this torch; pass --dtype float32")
        return Placement(dtype, device)

    def torch_dtype(self):
        if self.dtype == "auto":
            raise ConfigError("resolve the placement before loading (dtype auto)")
        return getattr(_torch(), self.dtype)

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "device": self.device}

    def describe(self) -> str:
        return f"{self.dtype} on {self.device}"

    def cache_suffix(self) -> str:
        """What a score-cache key adds for this (resolved) placement: nothing for float32
        on the CPU (the keys scores had before), the dtype and device kind otherwise."""
        if self.default:
            return ""
        return f"|{self.dtype}|{self.device.split(':')[0]}"


_COMPUTES: dict[tuple[str, str], bool] = {}


def computes(dtype: str, device: str) -> bool:
    """Whether torch runs a matmul and a softmax in ``dtype`` on ``device`` (probed once)."""
    if dtype == "float32":
        return True
    key = (dtype, device.split(":")[0])
    if key not in _COMPUTES:
        torch = _torch()
        try:
            x = torch.ones(2, 2, dtype=getattr(torch, dtype), device=device)
            (x @ x).softmax(-1).sum().item()
            _COMPUTES[key] = True
        except (RuntimeError, TypeError):
            _COMPUTES[key] = False
    return _COMPUTES[key]


def _torch():
    try:
        import torch
    except ImportError:
        raise BackendUnavailableError("torch is not installed; loading a model needs it: pip "
                                      "install 'calm-llm[train]'") from None
    return torch


def add_placement_arguments(parser, *, dtype_default: str = "auto",
                            device_default: str = "auto", what: str = "the model") -> None:
    """``--dtype`` and ``--device``, the same on every command that loads a model."""
    parser.add_argument("--dtype", default=dtype_default, type=check_dtype,
                        metavar="{" + ",".join(DTYPES) + "}",
                        help=f"precision {what} is loaded and run in (default "
                             f"{dtype_default}: the checkpoint's own, float32 where the device "
                             "cannot compute it); scores are read in float32 either way")
    parser.add_argument("--device", default=device_default, type=check_device,
                        metavar="{auto,cpu,cuda,cuda:N}",
                        help=f"where {what} runs (default {device_default}: cuda when torch "
                             "sees a GPU, else cpu)")


def return_free_memory() -> None:
    """Collect garbage and hand the C heap's free pages back to the system (glibc's
    ``malloc_trim``; a no-op elsewhere). Large weights freed by Python or torch can stay in
    the heap's arenas, counted in the resident set, until something asks for them back: a
    stage that drops a model calls this before the next one loads its own."""
    import gc

    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """glibc's ``malloc_trim(0)``: the free pages of every malloc arena (each thread's too)
    back to the system; a no-op where there is no glibc. No garbage collection: objects
    freed by reference counting are already in those arenas."""
    global _TRIM
    if _TRIM is None:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        try:
            _TRIM = ctypes.CDLL(name).malloc_trim if name else False
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


#: safetensors' dtype names, in torch's
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16",
                       "BF16": "bfloat16", "I64": "int64", "I32": "int32", "I16": "int16",
                       "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def read_converted(folder: Path, dtype):
    """The model in ``folder`` converted to ``dtype`` one tensor at a time, or ``None`` where
    this cannot be done exactly (then transformers loads it).

    transformers maps a checkpoint's files into memory and converts from there, so a
    bfloat16 checkpoint loaded as float32 holds the mapped file and the converted weights at
    once (1.5x the float32 weights). Here the parameters are created on the meta device
    (buffers, such as rotary tables, are made for real), each tensor is read from its file
    into a buffer of its own, converted and put in place: the peak is the converted weights
    and one tensor. Only ``*.safetensors`` files whose tensor names are the model's own
    parameters are read this way; anything else is left to transformers."""
    import torch
    import transformers

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    config = transformers.AutoConfig.from_pretrained(str(folder))
    with _parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    names = dict(model.named_parameters(remove_duplicate=False))
    seen = set()
    for file in files:
        with open(file, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
            base = 8 + size
            header.pop("__metadata__", None)
            # in the file's order: one forward pass over it
            for key, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                kind = _SAFETENSORS_DTYPES.get(info.get("dtype"))
                if key not in names or kind is None:
                    return None  # renamed or unknown tensors: transformers' own mapping
                start, end = info["data_offsets"]
                handle.seek(base + start)
                raw = bytearray(end - start)
                handle.readinto(raw)
                tensor = torch.frombuffer(raw, dtype=getattr(torch, kind)) if raw else \
                    torch.empty(0, dtype=getattr(torch, kind))
                tensor = tensor.reshape(info["shape"]).to(dtype)
                module_name, _, name = key.rpartition(".")
                module = model.get_submodule(module_name)
                module._parameters[name] = torch.nn.Parameter(tensor, requires_grad=False)
                seen.add(key)
    model.tie_weights()
    if any(p.is_meta for p in model.parameters()):
        return None
    for parameter in model.parameters():
        parameter.requires_grad_(True)  # as from_pretrained leaves them
    logger.debug("read %d tensors of %s as %s, one at a time", len(seen), folder, dtype)
    return model


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters registered meanwhile are moved to the meta device (no memory, no
    initialisation cost); buffers stay real."""
    import torch

    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None:
            module._parameters[name] = torch.nn.Parameter(
                module._parameters[name].to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def place_on(model, device: str):
    """``model`` (already on ``device``) with its tensor inputs moved there and its
    ``logits`` returned to the CPU, so that code written for the CPU (inputs built there,
    ``.numpy()`` on the scores) runs unchanged on a GPU; the KV cache stays on the device.
    Nothing is attached on the CPU."""
    if device == "cpu":
        return model
    import torch

    target = torch.device(device)

    def move(value):
        return value.to(target) if isinstance(value, torch.Tensor) else value

    def before(_module, args, kwargs):
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}

    def after(_module, _args, _kwargs, output):
        logits = getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor):
            output.logits = logits.cpu()
        return output

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)
    return model
