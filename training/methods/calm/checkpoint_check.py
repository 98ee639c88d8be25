"""A training checkpoint read and checked as a whole before ``--resume`` restores anything.

:func:`read_checkpoint` opens only regular files (a FIFO or device named ``state.json`` or
``tensors.safetensors`` is refused before it is opened, and opened without blocking), reads
``state.json`` bounded in size and nesting, reads the safetensors header by itself (its
length against the file's, every entry's name, dtype, shape and offsets against the model and
optimizer being resumed) before any tensor data, and range-checks the numbers a checkpoint
carries (the step against the run's settings and the folder's name, optimizer indices against
the optimizer's parameters, the optimizer's own step counts, finite values). Anything that does
not match is one :class:`~calm_runtime.errors.ArtifactError` line naming it, ending in
"start without --resume or from a checkpoint of this run"; nothing is restored then. No pickle
is ever read.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from calm_runtime.errors import ArtifactError, ConfigError
from calm_runtime.files import show, show_name

if TYPE_CHECKING:
    from calm_training.methods.calm.state import TrainingState


__all__ = ["CHECKPOINT_FORMAT", "MAX_HEADER_BYTES", "MAX_STATE_BYTES", "MAX_STATE_DEPTH",
           "RESUMABLE_CHANGES", "Restorable", "read_checkpoint", "step_number"]

CHECKPOINT_FORMAT = 1
#: settings that may change between a checkpoint and its resumption
RESUMABLE_CHANGES = ("steps", "checkpoint_every", "device")
#: the largest state.json read (the settings and one history row of ~1 KB per step)
MAX_STATE_BYTES = 256 << 20
#: the deepest nesting of objects and lists state.json may have (calm writes 3 levels)
MAX_STATE_DEPTH = 32
#: the largest safetensors header read (one ~150-byte entry per tensor)
MAX_HEADER_BYTES = 16 << 20
#: the longest integer literal state.json may hold (steps and counts have a few digits)
MAX_INT_DIGITS = 30
_FIX = "start without --resume or from a checkpoint of this run"
_STATE_KEYS = {"format", "step", "config", "theta_names", "optimizer_scalars", "history"}
#: keys a checkpoint may lack (one written before they were recorded)
_OPTIONAL_KEYS = {"seconds"}
_INDEX = re.compile(r"(0|[1-9][0-9]{0,8})", re.ASCII)
_STEP_FOLDER = re.compile(r"step-([0-9]{1,18})", re.ASCII)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass
class Restorable:
    """A checked checkpoint, ready to restore: values only, nothing applied yet."""

    step: int
    theta: list
    alpha: list
    optimizer: object  # the optimizer the state belongs to (warm start's or the method's)
    optimizer_state: dict
    rng: torch.Tensor
    history: list
    #: the training time of the steps the checkpoint holds (0 where it was not recorded)
    seconds: float = 0.0


def step_number(folder: Path) -> int | None:
    """The step of a ``step-NNNNNN`` folder name, or None for any other name."""
    match = _STEP_FOLDER.fullmatch(folder.name)
    return int(match.group(1)) if match else None


def _refuse(folder: Path, what: str) -> None:
    raise ArtifactError(f"checkpoint {show_name(str(folder))}: {what}; {_FIX}")


def _open_regular(folder: Path, name: str) -> tuple[int, int]:
    """``(fd, size)`` of the regular file ``folder/name``, opened without blocking; any
    other kind of file is refused before it is opened."""
    path = folder / name
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            _refuse(folder, f"{name} is not a regular file (a folder, FIFO or device)")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        _refuse(folder, f"{name} is missing")
    except (OSError, ValueError) as exc:
        _refuse(folder, f"{name} cannot be opened ({getattr(exc, 'strerror', None) or exc})")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # replaced between the two looks
        os.close(fd)
        _refuse(folder, f"{name} is not a regular file (a folder, FIFO or device)")
    return fd, info.st_size


def _read_exactly(fd: int, size: int, offset: int = 0) -> bytes:
    chunks, done = [], 0
    while done < size:
        block = os.pread(fd, min(size - done, 1 << 24), offset + done)
        if not block:
            break
        chunks.append(block)
        done += len(block)
    return b"".join(chunks)


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits")
    return int(text)


def _too_deep(value, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(
            item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _json(folder: Path, name: str, raw: bytes):
    """JSON of ``raw``, integers and nesting bounded; one line on anything else."""
    try:
        data = json.loads(raw.decode("utf-8"), parse_int=_bounded_int)
    except UnicodeDecodeError as exc:
        _refuse(folder, f"{name} is not UTF-8 ({exc.reason} at byte {exc.start})")
    except RecursionError:
        _refuse(folder, f"{name} is nested deeper than {MAX_STATE_DEPTH} levels")
    except ValueError as exc:  # JSONDecodeError included
        _refuse(folder, f"{name} is not valid JSON ({str(exc).splitlines()[0][:120]})")
    if _too_deep(data, MAX_STATE_DEPTH):
        _refuse(folder, f"{name} is nested deeper than {MAX_STATE_DEPTH} levels")
    return data


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_scalar(value) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _read_state(folder: Path) -> dict:
    fd, size = _open_regular(folder, "state.json")
    try:
        if size > MAX_STATE_BYTES:
            _refuse(folder, f"state.json has {size:,} bytes, more than the "
                            f"{MAX_STATE_BYTES:,} read")
        raw = _read_exactly(fd, size)
    finally:
        os.close(fd)
    payload = _json(folder, "state.json", raw)
    if not isinstance(payload, dict):
        _refuse(folder, "state.json is not a JSON object")
    if payload.get("format") != CHECKPOINT_FORMAT or not _is_int(payload.get("format")):
        _refuse(folder, f"format {show(payload.get('format'))}, not {CHECKPOINT_FORMAT} (resume "
                        "with the calm version that wrote it)")
    keys = set(payload) - _OPTIONAL_KEYS
    if keys != _STATE_KEYS:
        extra, missing = sorted(keys - _STATE_KEYS), sorted(_STATE_KEYS - keys)
        _refuse(folder, "state.json " + (f"has unknown key(s) {show(extra)}" if extra else
                                         f"lacks {show(missing)}"))
    for key, kind in (("config", dict), ("theta_names", list), ("optimizer_scalars", dict),
                      ("history", list)):
        if not isinstance(payload[key], kind):
            _refuse(folder, f"state.json's {key} is a {type(payload[key]).__name__}, not a "
                            f"JSON {'object' if kind is dict else 'list'}")
    seconds = payload.get("seconds", 0.0)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) \
            or not 0 <= seconds < float("inf"):
        _refuse(folder, f"state.json's seconds {show(seconds)} is not a training time in "
                        "seconds")
    return payload


def _check_step(folder: Path, payload: dict, config) -> int:
    step = payload["step"]
    if not _is_int(step):
        _refuse(folder, f"state.json's step {show(step)} is not an integer")
    if not 0 <= step <= config.steps:
        _refuse(folder, f"state.json's step {show(step)} is outside 0..{config.steps} (the "
                        "run's steps)")
    named = step_number(folder)
    if named is not None and named != step:
        _refuse(folder, f"state.json's step {step} is not the folder's step {named}")
    history = payload["history"]
    if len(history) != step:
        _refuse(folder, f"state.json's history has {len(history)} rows for {step} steps")
    for i, row in enumerate(history):
        if not isinstance(row, dict) or row.get("step") != i + 1 or not all(
                isinstance(k, str) and _is_scalar(v) for k, v in row.items()):
            _refuse(folder, f"state.json's history row {i + 1} is not the log row of step "
                            f"{i + 1}")
        q = row.get("q")
        if q is not None and (isinstance(q, bool) or not isinstance(q, int | float)):
            _refuse(folder, f"state.json's history row {i + 1} has q {show(q)}, not a number")
    return step


def _check_config(folder: Path, payload: dict, state: TrainingState) -> None:
    now, then = state.config.to_dict(), payload["config"]
    changed = sorted(k for k in set(now) | set(then)
                     if k not in RESUMABLE_CHANGES and now.get(k) != then.get(k))
    if changed:
        raise ConfigError(f"cannot resume from {show_name(str(folder))}: settings differ in "
                          + ", ".join(f"{show(k)} ({show(then.get(k))} -> {show(now.get(k))})"
                                      for k in changed[:8])
                          + "; use the original settings")
    if payload["theta_names"] != state.model.names:
        _refuse(folder, "it holds other LoRA tensors than this model (theta_names differ)")


def _state_layout(optimizer) -> list[dict]:
    """Per parameter of ``optimizer``: ``{key: (shape, dtype), or None for a non-tensor}``
    of the state it keeps, read off a copy of it stepped once on zero gradients."""
    copies, groups = [], []
    for group in optimizer.param_groups:
        params = [torch.zeros_like(p, requires_grad=True) for p in group["params"]]
        copies += params
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    probe = type(optimizer)(groups)
    for copy in copies:
        copy.grad = torch.zeros_like(copy)
    probe.step()
    return [{key: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else None
             for key, v in probe.state[copy].items()} for copy in copies]


def _expected(state: TrainingState, optimizer) -> tuple[dict, list]:
    m = state.model
    want = {f"theta/{n}": (tuple(p.shape), p.dtype) for n, p in zip(m.names, m.theta,
                                                                     strict=True)}
    want.update({f"alpha/{n}": (tuple(a.shape), a.dtype)
                 for n, a in zip(m.alpha_names, m.alpha, strict=True)})
    want["rng/torch"] = (tuple(torch.get_rng_state().shape), torch.uint8)
    return want, _state_layout(optimizer)


def _optim_key(folder: Path, name: str, layout: list, *, tensor: bool) -> tuple[int, str]:
    """``(index, key)`` of an optimizer entry ``INDEX/KEY``, checked against ``layout``."""
    index, _, key = name.partition("/")
    where = (f"tensor {show('optim/' + name)}" if tensor
             else f"optimizer_scalars entry {show(name)}")
    if not _INDEX.fullmatch(index) or not key:
        _refuse(folder, f"{where} is not INDEX/KEY with an integer INDEX")
    if int(index) >= len(layout):
        _refuse(folder, f"{where} names parameter {index} of an optimizer with "
                        f"{len(layout)} parameters")
    kind = layout[int(index)].get(key, "absent")
    if kind == "absent" or (kind is None) == tensor:
        _refuse(folder, f"{where} is not state this run's optimizer keeps "
                        f"({show(sorted(layout[int(index)]))})")
    return int(index), key


def _read_header(folder: Path, fd: int, size: int) -> tuple[dict, int]:
    name = "tensors.safetensors"
    head = _read_exactly(fd, 8)
    if len(head) < 8:
        _refuse(folder, f"{name} has {size} bytes, too short for a safetensors file")
    if head[:4] == b"PK\x03\x04":
        _refuse(folder, f"{name} is a zip archive (a torch pickle?), not safetensors; calm "
                        "never loads pickles")
    length = struct.unpack("<Q", head)[0]
    if length > min(MAX_HEADER_BYTES, size - 8):
        _refuse(folder, f"{name} is not a safetensors file (its header length {length:,} "
                        f"is more than the file's {size:,} bytes or the {MAX_HEADER_BYTES:,} "
                        "read)")
    raw = _read_exactly(fd, length, 8)
    if not raw.startswith(b"{"):
        _refuse(folder, f"{name} is not a safetensors file (its header is not a JSON object)")
    header = _json(folder, f"{name}'s header", raw)
    if not isinstance(header, dict):
        _refuse(folder, f"{name}'s header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + length


def _check_entry(folder: Path, name: str, entry, want: tuple) -> tuple[int, int]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        _refuse(folder, f"tensor {show(name)}'s entry is not dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    shape_ok = isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)
    if not shape_ok or tuple(shape) != want[0]:
        _refuse(folder, f"tensor {show(name)} has shape {show(shape)}, this run's is "
                        f"{list(want[0])}")
    if _DTYPES.get(dtype) is not want[1]:
        _refuse(folder, f"tensor {show(name)} has dtype {show(dtype)}, this run's is "
                        f"{_DTYPE_NAMES.get(want[1], want[1])}")
    nbytes = math.prod(want[0]) * torch.empty((), dtype=want[1]).element_size()
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_int, offsets))
            or offsets[1] - offsets[0] != nbytes or offsets[0] < 0):
        _refuse(folder, f"tensor {show(name)} has data_offsets {show(offsets)}, not the "
                        f"{nbytes} bytes of its shape and dtype")
    return offsets[0], offsets[1]


def _read_tensors(folder: Path, want: dict, layout: list) -> dict:
    """The tensors file's tensors, its header checked entry by entry against ``want`` (and
    the optimizer entries against ``layout``) before any data is read."""
    from safetensors.torch import load as load_bytes

    fd, size = _open_regular(folder, "tensors.safetensors")
    try:
        header, start = _read_header(folder, fd, size)
        spans = []
        for name, entry in header.items():
            if not isinstance(name, str):
                _refuse(folder, f"tensors.safetensors holds a tensor named {show(name)}")
            if name.startswith("optim/"):
                index, key = _optim_key(folder, name[len("optim/"):], layout, tensor=True)
                expected = layout[index][key]
            elif name in want:
                expected = want[name]
            else:
                _refuse(folder, f"tensors.safetensors holds {show(name)}, which this run "
                                "does not have")
            spans.append(_check_entry(folder, name, entry, expected))
        missing = sorted(set(want) - set(header))
        if missing:
            _refuse(folder, f"tensors.safetensors lacks {show(missing[0])}"
                            + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
        end = 0
        for begin, stop in sorted(spans):
            if begin != end:
                _refuse(folder, "tensors.safetensors's tensors overlap or leave gaps")
            end = stop
        if start + end != size:
            _refuse(folder, f"tensors.safetensors has {size:,} bytes, its header describes "
                            f"{start + end:,}")
        raw = _read_exactly(fd, size)
    finally:
        os.close(fd)
    if len(raw) != size:
        _refuse(folder, "tensors.safetensors changed while it was read")
    try:
        return load_bytes(raw)
    except Exception as exc:  # the format's own parser: one line, whatever it says
        _refuse(folder, f"tensors.safetensors cannot be read ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:120] if str(exc) else ''})")


def read_checkpoint(state: TrainingState, folder: Path) -> Restorable:
    """Read and check the checkpoint ``folder`` against ``state`` (its model, optimizers and
    settings); a :class:`Restorable` when every part matches, else one line."""
    folder = Path(folder)
    payload = _read_state(folder)
    _check_config(folder, payload, state)
    step = _check_step(folder, payload, state.config)
    # the optimizer of the step after the checkpoint: the warm start's or the method's
    warming = state.warm_optimizer is not None and step < state.config.warm_steps
    optimizer = state.warm_optimizer if warming else state.outer_optimizer
    want, layout = _expected(state, optimizer)
    scalars: dict = {}
    for name, value in payload["optimizer_scalars"].items():
        index, key = _optim_key(folder, name, layout, tensor=False)
        if not _is_scalar(value):
            _refuse(folder, f"optimizer_scalars entry {show(name)} is {show(value)}, not a "
                            "number, string or null")
        scalars.setdefault(index, {})[key] = value
    tensors = _read_tensors(folder, want, layout)
    optim_state: dict = {}
    for name, value in tensors.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            _refuse(folder, f"tensor {show(name)} holds non-finite values")
        if name.startswith("optim/"):
            index, _, key = name[len("optim/"):].partition("/")
            optim_state.setdefault(int(index), {})[key] = value
    for index, entries in scalars.items():
        optim_state.setdefault(index, {}).update(entries)
    for index, entries in optim_state.items():
        if set(entries) != set(layout[index]):
            _refuse(folder, f"the optimizer state of parameter {index} has "
                            f"{show(sorted(entries))}, this run's optimizer keeps "
                            f"{show(sorted(layout[index]))}")
        count = entries.get("step")
        if torch.is_tensor(count):
            value = float(count)
            if value != int(value) or not 0 <= value <= step:
                _refuse(folder, f"the optimizer step count of parameter {index} is {value:g}, "
                                f"not a whole number in 0..{step} (the checkpoint's step)")
    m = state.model
    return Restorable(step=step, theta=[tensors[f"theta/{n}"] for n in m.names],
                      alpha=[tensors[f"alpha/{n}"] for n in m.alpha_names],
                      optimizer=optimizer, optimizer_state=optim_state, rng=tensors["rng/torch"],
                      history=list(payload["history"]),
                      seconds=float(payload.get("seconds", 0.0)))
