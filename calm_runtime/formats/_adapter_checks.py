"""Strict reading of a calibration adapter's parts: the safetensors file (header, dtypes,
shapes, size bounds), the base-model identity, the abstention section, and the small
type checks the manifest reader uses. Every failure is a one-line
:class:`~calm_runtime.errors.ArtifactError` naming the file and the fix."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from calm_runtime.errors import ArtifactError
from calm_runtime.files import read_regular_file, show, show_name

_TENSOR_KEYS = {"tau", "shift", "temperature", "answer_temperature"}
_REQUIRED_TENSORS = {"tau", "shift", "temperature"}
_SCALAR_TENSORS = ("temperature", "answer_temperature")
#: The largest ``base_model.vocab_size`` an adapter may have (2**24; real models have < 300k).
#: It bounds what loading an adapter reads: the tensors file is at most ~8 bytes per token.
MAX_VOCAB_SIZE = 1 << 24
#: The largest safetensors header calm reads (calm writes a few hundred bytes).
MAX_TENSORS_HEADER_BYTES = 1 << 20
#: safetensors dtype names, for messages that refuse them
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F64": "float64", "F32": "float32",
                       "F8_E4M3": "float8_e4m3", "F8_E5M2": "float8_e5m2", "I8": "int8",
                       "I16": "int16", "I32": "int32", "I64": "int64", "U8": "uint8",
                       "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool"}


def load_tensors(path: Path, vocab: int, entries: Any, where: str) -> dict[str, np.ndarray]:
    """Read the tensors file, checking its header before any tensor data is touched.

    The file may hold at most what a valid adapter of ``vocab`` tokens holds (plus a header
    of at most :data:`MAX_TENSORS_HEADER_BYTES`), so a huge or sparse file is refused by its
    size. The header's names, dtypes, shapes and byte offsets must describe exactly the
    bytes that follow it, and match ``tensors.entries`` of the manifest when that is given.
    """
    shown = show_name(str(path))
    limit = 8 + MAX_TENSORS_HEADER_BYTES + 4 * (2 * vocab + len(_SCALAR_TENSORS))
    raw = read_regular_file(path, limit=limit, what="calibration tensors file")
    header = _safetensors_header(raw, path)
    names = set(header)
    unknown = sorted(names - _TENSOR_KEYS)
    if unknown:
        raise ArtifactError(f"{shown} has unknown tensor(s) {show(unknown)}; it was "
                            f"written by another tool (allowed: {sorted(_TENSOR_KEYS)})")
    for name in sorted(names):
        dtype = header[name]["dtype"]
        if dtype != "F32":
            raise ArtifactError(f"tensor {name!r} in {shown} is "
                                f"{_SAFETENSORS_DTYPES.get(dtype, show(dtype))}, not float32; "
                                "re-create the artifact with float32 tensors")
    missing = sorted(_REQUIRED_TENSORS - names)
    if missing:
        raise ArtifactError(f"{shown} lacks tensor(s) {missing}; re-create the adapter")
    for name in ("tau", "shift"):
        shape = header[name]["shape"]
        if shape != [vocab]:
            raise ArtifactError(f"{name} has shape {show(shape)} but the vocabulary has {vocab} "
                                "tokens; re-fit for this model")
    for name in _SCALAR_TENSORS:
        if name in header and math.prod(header[name]["shape"]) != 1:
            raise ArtifactError(f"{name} must be a scalar, got shape "
                                f"{show(header[name]['shape'])}; re-create the adapter")
    if entries is not None:
        _check_entries(entries, header, path, where)
    from safetensors.numpy import load

    try:
        arrays = load(raw)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - the Rust reader may also panic
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200] or type(exc).__name__
        raise ArtifactError(f"{shown} is not a readable safetensors file ({reason}); "
                            "it is truncated or corrupted, re-create the artifact") from None
    if set(arrays) != names or any(a.dtype != np.float32 for a in arrays.values()):
        raise ArtifactError(f"{shown} is not a readable safetensors file (its "
                            "tensors differ from its header); re-create the artifact")
    return {name: np.array(array, dtype=np.float32) for name, array in arrays.items()}


def _safetensors_header(raw: bytes, path: Path) -> dict[str, dict]:
    """The tensor entries of a safetensors header, checked against the file's real size."""
    shown = show_name(str(path))

    def refuse(reason: str) -> ArtifactError:
        return ArtifactError(f"{shown} is not a readable safetensors file ({reason}); "
                             "it is truncated or corrupted, re-create the artifact")

    if len(raw) < 8:
        raise refuse(f"{len(raw)} bytes, shorter than the 8-byte header length")
    size = int.from_bytes(raw[:8], "little")
    if size > MAX_TENSORS_HEADER_BYTES or 8 + size > len(raw):
        raise refuse(f"the header claims {size} bytes but the file has {len(raw) - 8} after "
                     "the length")
    try:
        header = json.loads(raw[8:8 + size].decode("utf-8"))
    except (ValueError, RecursionError, MemoryError):
        raise refuse("the header is not valid JSON") from None
    if not isinstance(header, dict):
        raise refuse("the header is not a JSON object")
    data_size = len(raw) - 8 - size
    tensors: dict[str, dict] = {}
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str)
                                                       for v in entry.values()):
                raise refuse("__metadata__ is not a map of strings")
            continue
        if (not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}
                or not isinstance(entry["dtype"], str)
                or not _int_list(entry["shape"]) or not _int_list(entry["data_offsets"])
                or len(entry["data_offsets"]) != 2):
            raise refuse(f"the entry of tensor {show(name)} is malformed")
        begin, end = entry["data_offsets"]
        if not begin <= end <= data_size:
            raise refuse(f"tensor {show(name)} spans bytes {begin}..{end}, past the "
                         f"{data_size} bytes of data")
        if entry["dtype"] == "F32" and end - begin != 4 * math.prod(entry["shape"]):
            raise refuse(f"tensor {show(name)} of shape {show(entry['shape'])} needs "
                         f"{4 * math.prod(entry['shape'])} bytes, its offsets give "
                         f"{end - begin}")
        tensors[name] = entry
        spans.append((begin, end))
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise refuse("the tensors' byte ranges overlap or leave gaps")
        position = end
    if position != data_size:
        raise refuse(f"the tensors cover {position} of the {data_size} data bytes")
    return tensors


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _check_entries(entries: Any, header: dict[str, dict], path: Path, where: str) -> None:
    """``tensors.entries`` must name exactly the file's tensors, with their shapes and dtypes."""
    def mismatch(detail: str) -> ArtifactError:
        return ArtifactError(f"{where}: tensors.entries does not match {show_name(str(path))} "
                             f"({detail}); re-create the adapter")

    if not isinstance(entries, dict):
        raise ArtifactError(f"{where}: tensors.entries must be an object, got "
                            f"{type(entries).__name__}; re-create the adapter")
    if set(entries) != set(header):
        raise mismatch(f"entries name {show(sorted(entries))}, the file holds "
                       f"{sorted(header)}")
    for name in sorted(header):
        entry, shape = entries[name], header[name]["shape"]
        if not isinstance(entry, dict) or set(entry) != {"shape", "dtype"}:
            raise mismatch(f"{name!r} must be {{\"shape\": [...], \"dtype\": \"float32\"}}, "
                           f"got {show(entry)}")
        if not isinstance(entry["dtype"], str) or entry["dtype"] != "float32":
            raise mismatch(f"{name!r} has dtype {show(entry['dtype'])} in the manifest, "
                           "float32 in the file")
        if not _int_list(entry["shape"]) or entry["shape"] != shape:
            raise mismatch(f"{name!r} has shape {show(entry['shape'])} in the manifest, "
                           f"{shape} in the file")


def check_abstention(value: Any, where: str) -> dict | None:
    """``None``, or an object whose ``threshold`` is a number in [0, 1] (other keys: how it
    was chosen)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or "threshold" not in value:
        raise ArtifactError(f"{where}: abstention must be an object with a threshold, got "
                            f"{show(value)}; re-run calm fit threshold")
    threshold = value["threshold"]
    if (isinstance(threshold, bool) or not isinstance(threshold, int | float)
            or not 0.0 <= threshold <= 1.0):
        raise ArtifactError(f"{where}: abstention.threshold must be a number in [0, 1], got "
                            f"{show(threshold)}; re-run calm fit threshold")
    return dict(value)


def float32_array(value: Any, name: str) -> np.ndarray:
    try:
        with np.errstate(all="ignore"):  # too large for float32: inf, refused below
            return np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError, OverflowError):
        raise ArtifactError(f"{name} must be an array of numbers, got "
                            f"{type(value).__name__}; pass a float32 vector") from None


def check_range(checked: np.ndarray, name: str, low: float, high: float, shown: str, *,
                 values: np.ndarray | None = None) -> None:
    """Refuse entries of ``checked`` outside ``[low, high]``, naming the first one."""
    bad = np.flatnonzero((checked < low) | (checked > high))
    if bad.size:
        value = (checked if values is None else values)[bad[0]]
        raise ArtifactError(f"{name} has {bad.size} entries outside the allowed range {shown} "
                            f"(first at token id {bad[0]}: {name}[{bad[0]}] = {value:g}); "
                            "re-fit the calibration")


def optional_mapping(value: Any, name: str, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ArtifactError(f"{where}: {name} must be an object, got {type(value).__name__}")
    return dict(value)


def non_empty_string(value: Any, name: str, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ArtifactError(f"{where}: {name} must be a non-empty string, got {show(value)}")
    return value
