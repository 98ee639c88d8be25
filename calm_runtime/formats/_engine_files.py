"""What an engine's hashes cannot vouch for, checked on every load (issue 38): the
contents of ``genai_config.json`` against the manifest's model section, and the files
``model.onnx`` reads as external data against ``model.files``. onnxruntime-genai runs the
folder by the first, onnxruntime reads the second, so a folder whose files are each
"intact" (their sha256 recorded) can still describe another graph or read a file no hash
covers. Every problem is a one-line :class:`~calm_runtime.errors.ArtifactError` naming the
file, the field and the fix (re-export). Neither torch nor onnx is imported: the graph's
protobuf is walked here, without loading any weights."""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Mapping
from typing import Any

from calm_runtime.errors import ArtifactError
from calm_runtime.files import read_regular_file, resolve_inside, show, show_name
from calm_runtime.formats._engine_checks import MODEL_NUMBER_LIMIT
from calm_runtime.formats.manifest import MAX_MANIFEST_BYTES, parse_json

__all__ = ["check_genai_config", "check_external_data", "onnx_external_locations"]


# ---------------------------------------------------------------------- genai_config.json
#: what the manifest's ``model`` section calls the sizes ``genai_config.json`` repeats
_GENAI_SIZES = (("vocab_size", ("vocab_size",)),
                ("num_layers", ("decoder", "num_hidden_layers")),
                ("num_attention_heads", ("decoder", "num_attention_heads")),
                ("num_kv_heads", ("decoder", "num_key_value_heads")),
                ("head_dim", ("decoder", "head_size")),
                ("hidden_size", ("decoder", "hidden_size")))
#: search settings that are counts (``(key, smallest allowed)``); ``max_length`` is
#: checked against the context
_GENAI_SEARCH_COUNTS = (("min_length", 0), ("num_beams", 1), ("num_return_sequences", 1),
                        ("top_k", 0), ("no_repeat_ngram_size", 0), ("chunk_size", 1))
_GENAI_SEARCH_RATES = ("temperature", "top_p", "repetition_penalty")
_GENAI_FIX = "re-export the engine with calm-export (it writes this file)"


def check_genai_config(path, model: Mapping, manifest_name: str) -> None:
    """``genai_config.json`` (already hashed) against the manifest's ``model`` section.

    onnxruntime-genai runs the engine folder by this file alone, so a copy whose sizes
    disagree with the graph (KV heads, head size, layers, vocabulary), whose context is
    longer than the model's, or whose numbers are negative or absurd is refused here
    rather than served: one :class:`ArtifactError` line naming the file, the field and the
    fix."""
    name = show_name(str(path))
    data = parse_json(read_regular_file(path, limit=MAX_MANIFEST_BYTES,
                                        what="genai_config.json"), name, _GENAI_FIX)
    if not isinstance(data, dict):
        raise ArtifactError(f"{name} must hold a JSON object, got {type(data).__name__}; "
                            f"{_GENAI_FIX}")
    section = _genai_object(data, ("model",), name)
    _genai_object(section, ("decoder",), name, "model.")
    for key, where in _GENAI_SIZES:
        expected = model.get(key)
        if expected is None:  # num_attention_heads: older manifests do not record it
            continue
        value = _genai_count(section, where, name, low=1)
        if value != expected:
            raise ArtifactError(f"{name}: model.{'.'.join(where)} is {value}, but "
                                f"{manifest_name} states {key} {expected}; the engine's files "
                                f"disagree, {_GENAI_FIX}")
    context = _genai_count(section, ("context_length",), name, low=1)
    if context > model["max_position_embeddings"]:
        raise ArtifactError(f"{name}: model.context_length {context} is longer than the "
                            f"model's max_position_embeddings {model['max_position_embeddings']}"
                            f" ({manifest_name}); {_GENAI_FIX}")
    filename = section["decoder"].get("filename")
    if filename != "model.onnx":
        raise ArtifactError(f"{name}: model.decoder.filename {show(filename)} is not the "
                            f"engine's graph 'model.onnx'; {_GENAI_FIX}")
    vocab = model["vocab_size"]
    for key in ("bos_token_id", "pad_token_id", "eos_token_id", "bot_token_id",
                "eot_token_id", "bor_token_id", "eor_token_id"):
        value = section.get(key)
        if value is None:
            continue
        if key == "pad_token_id" and value == -1 and not isinstance(value, bool):
            continue  # "no padding token", as the builder copies it from such a config
        for item in (value if key == "eos_token_id" and isinstance(value, list) else [value]):
            if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < vocab:
                raise ArtifactError(f"{name}: model.{key} must be a token id in [0, {vocab}), "
                                    f"got {show(value)}; {_GENAI_FIX}")
    window = section["decoder"].get("sliding_window")
    if window is not None:
        _genai_object(section, ("decoder", "sliding_window"), name, "model.")
        _genai_count(section, ("decoder", "sliding_window", "window_size"), name, low=1)
        layers = window.get("layers", [])
        if not isinstance(layers, list) or not all(
                isinstance(i, int) and not isinstance(i, bool)
                and 0 <= i < model["num_layers"] for i in layers):
            raise ArtifactError(f"{name}: model.decoder.sliding_window.layers must list layer "
                                f"indices in [0, {model['num_layers']}), got {show(layers)}; "
                                f"{_GENAI_FIX}")
    if "search" not in data:
        return
    search = _genai_object(data, ("search",), name)
    if "max_length" in search:
        length = _genai_count(search, ("max_length",), name, low=1, prefix="search.")
        if length > context:
            raise ArtifactError(f"{name}: search.max_length {length} is longer than "
                                f"model.context_length {context}; {_GENAI_FIX}")
    for key, low in _GENAI_SEARCH_COUNTS:
        if key in search:
            _genai_count(search, (key,), name, low=low, prefix="search.")
    for key in _GENAI_SEARCH_RATES:
        value = search.get(key)
        if value is None:
            continue
        high = 1.0 if key == "top_p" else float(MODEL_NUMBER_LIMIT)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 <= value <= high:
            raise ArtifactError(f"{name}: search.{key} must be a number in [0, {high:g}], got "
                                f"{show(value)}; {_GENAI_FIX}")


def _genai_object(section: Mapping, where: tuple[str, ...], name: str, prefix: str = "") -> dict:
    value = _genai_lookup(section, where, name, prefix)
    if not isinstance(value, Mapping):
        raise ArtifactError(f"{name}: {prefix}{'.'.join(where)} must be an object, got "
                            f"{show(value)}; {_GENAI_FIX}")
    return dict(value)


def _genai_count(section: Mapping, where: tuple[str, ...], name: str, *, low: int,
                 prefix: str = "model.") -> int:
    value = _genai_lookup(section, where, name, prefix)
    if isinstance(value, bool) or not isinstance(value, int) \
            or not low <= value <= MODEL_NUMBER_LIMIT:
        raise ArtifactError(f"{name}: {prefix}{'.'.join(where)} must be an integer in "
                            f"[{low}, {MODEL_NUMBER_LIMIT:,}], got {show(value)}; {_GENAI_FIX}")
    return value


def _genai_lookup(section: Mapping, where: tuple[str, ...], name: str, prefix: str) -> Any:
    value: Any = section
    for depth, key in enumerate(where):
        if not isinstance(value, Mapping) or key not in value:
            raise ArtifactError(f"{name} lacks {prefix}{'.'.join(where[:depth + 1])}; "
                                f"{_GENAI_FIX}")
        value = value[key]
    return value


# ---------------------------------------------------------------------- ONNX external data
# Field numbers of onnx.proto's messages on the way from a ModelProto to every TensorProto
# (initializers, sparse initializers, Constant and other tensor attributes, subgraphs,
# functions, training info): {message: {field number: the message it holds}}.
_ONNX_CHILDREN = {
    "model": {7: "graph", 20: "training", 25: "function"},
    "training": {1: "graph", 2: "graph"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "function": {7: "node"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse",
                  23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},
    "tensor": {13: "entry"},
}
_TENSOR_DATA_LOCATION, _EXTERNAL = 14, 1


class _Malformed(Exception):
    def __init__(self, reason: str, at: int) -> None:
        super().__init__(f"{reason} at byte {at}")


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Malformed("a truncated or over-long varint", pos)
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _proto_fields(buf, start: int, end: int):
    """``(field number, wire type, value)`` of one protobuf message in ``buf[start:end]``;
    a length-delimited value is its ``(start, end)``."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise _Malformed("field number 0", pos)
        if wire == 0:
            value, pos = _varint(buf, pos, end)
        elif wire == 2:
            length, pos = _varint(buf, pos, end)
            if length > end - pos:
                raise _Malformed("a field longer than its message", pos)
            value, pos = (pos, pos + length), pos + length
        elif wire in (1, 5):
            value, pos = None, pos + (8 if wire == 1 else 4)
            if pos > end:
                raise _Malformed("a truncated fixed-size field", pos)
        else:
            raise _Malformed(f"wire type {wire}", pos)
        yield number, wire, value


def onnx_external_locations(buf) -> set[str]:
    """Every file an ONNX graph's tensors name as their external data (``location``),
    read from the ``ModelProto`` bytes ``buf`` without loading any data and without the
    ``onnx`` package (a walk of the protobuf). Raises :class:`_Malformed`, or
    :class:`ValueError` for a tensor stored externally that names no file."""
    locations: set[str] = set()
    stack = [("model", 0, len(buf))]
    while stack:
        kind, start, end = stack.pop()
        children = _ONNX_CHILDREN.get(kind, {})
        named, external = [], False
        for number, wire, value in _proto_fields(buf, start, end):
            child = children.get(number)
            if kind == "tensor" and number == _TENSOR_DATA_LOCATION and wire == 0:
                external = value == _EXTERNAL
            if child is None:
                continue
            if wire != 2:
                raise _Malformed(f"{kind} field {number} is not a message", start)
            if child == "entry":
                entry = {k: v for k, w, v in _proto_fields(buf, *value) if w == 2}
                if 1 in entry and bytes(buf[slice(*entry[1])]) == b"location":
                    text = bytes(buf[slice(*entry.get(2, (0, 0)))])
                    try:
                        named.append(text.decode("utf-8"))
                    except UnicodeDecodeError:
                        raise _Malformed("an external data location that is not UTF-8",
                                         value[0]) from None
            else:
                stack.append((child, *value))
        if external and not named:
            raise ValueError("a tensor stored as external data names no location")
        locations.update(named)
    return locations


def check_external_data(root, model: Mapping, manifest_name: str) -> None:
    """The files ``model.onnx`` reads as external data are exactly the ones the manifest
    lists (and hashes) in ``model.files`` besides the graph (and a TensorRT plan): a graph
    that reads an unlisted file — whose bytes no sha256 vouches for — is refused, and so
    is a listed data file the graph does not read (the files are not the ones exported)."""
    path = resolve_inside(root, "model.onnx")
    name = show_name(str(path))
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise ArtifactError(f"{name} cannot be opened ({reason}); copy the engine again or "
                            "re-export it") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ArtifactError(f"{name} is not a regular file; re-export the engine")
        view = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if info.st_size else b""
        try:
            locations = onnx_external_locations(view)
        except _Malformed as exc:
            raise ArtifactError(f"{name} is not a readable ONNX graph (protobuf: {exc}); "
                                "copy the engine again or re-export it") from None
        except ValueError as exc:
            raise ArtifactError(f"{name} has {exc}; re-export the engine") from None
        finally:
            if info.st_size:
                view.close()
    except OSError as exc:
        raise ArtifactError(f"{name} cannot be read ({exc.strerror or type(exc).__name__}); "
                            "copy the engine again or re-export it") from None
    finally:
        os.close(fd)
    listed = set(model["files"]) - {"model.onnx", model["file"]}
    unlisted, unread = sorted(locations - listed), sorted(listed - locations)
    if unlisted:
        raise ArtifactError(f"{name} reads external data from {show_name(unlisted[0])}, which "
                            f"{manifest_name} does not list in model.files (no sha256 vouches "
                            "for it); the graph was changed after the export, re-export the "
                            "engine")
    if unread:
        raise ArtifactError(f"{manifest_name} lists {show_name(unread[0])} in model.files, "
                            f"but {name} reads no external data from it; the graph is not the "
                            "one exported with these files, re-export the engine")
