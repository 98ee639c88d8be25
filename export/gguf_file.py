"""GGUF files for ``calm-export --format gguf`` (export/gguf.py): a model's original GGUF, and
the file at the byte level.

What is copied is copied as bytes: a source key/value pair is the exact byte run the source
file holds for it (``ReaderField.parts``), a source tensor is the exact byte run of its data;
only the tensors and keys calm adds (or, for a soft-capped head, rewrites) are encoded here.
The layout (GGUF v2/v3, little-endian; the GGUF specification in the ggml repository):

    magic "GGUF" | version u32 | tensor count u64 | key/value count u64
    key/value pairs: key (u64 length + UTF-8) | value type u32 | value
    tensor infos: name | n_dims u32 | dims u64 x n_dims (ne0 first) | type u32 | offset u64
    padding to ``general.alignment`` (default 32) | tensor data, each at an aligned offset

The header is read by calm's own walk (calm_runtime/formats/gguf_layout.py: every count
bounded by a named cap and by the file's size, nothing built per array item), the tensor
data through a memory map; the ``gguf`` package (llama.cpp's own, in the train extra)
supplies the type tables and dequantises the head.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import os
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from calm_runtime.data.models import PACKAGED_MODELS
from calm_runtime.errors import ArtifactError, BackendUnavailableError, ModelSourceError
from calm_runtime.files import show_name
from calm_runtime.formats.gguf_layout import (
    GGUFKey,
    GGUFLayout,
    read_gguf_layout,
    require_regular_file,
)

__all__ = ["BLOCK_SCALES", "GGUFSource", "SourceTensor", "TensorOut", "VALUE_TYPE_NAMES",
           "encode_kv", "float32_problem", "gguf_origin", "open_source", "require_gguf",
           "rescale_rows", "source_gguf", "verify_copy", "write_gguf"]

#: GGUF value types (the GGUF specification): the ones calm writes
_UINT32, _FLOAT32, _BOOL, _STRING, _ARRAY = 4, 6, 7, 8, 9
#: every GGUF value type by number, for messages
VALUE_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32",
                    6: "float32", 7: "bool", 8: "string", 9: "array", 10: "uint64",
                    11: "int64", 12: "float64"}
_MAGIC = b"GGUF"
_COPY_CHUNK = 1 << 24
#: padding is written from one block of zeros of this size, never as one object
_ZEROS = bytes(1 << 16)
#: numpy types of the ggml types stored one value per element (others are byte blocks)
_PLAIN_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                "I16": np.int16, "I32": np.int32, "I64": np.int64}


def require_gguf():
    """The ``gguf`` package (llama.cpp's reader), or one line naming the extra."""
    try:
        import gguf
    except ImportError:
        raise BackendUnavailableError(
            "--format gguf reads the model with the gguf package (llama.cpp's GGUF reader), "
            "which is not installed; it comes with the train extra: pip install "
            "'calm-llm[train]' (or pip install gguf)") from None
    return gguf


def gguf_origin(spec, folder: Path) -> str | None:
    """The GGUF a model was made from (a ``.gguf`` path or a packaged name), or None: the
    spec itself, or the ``calm_source.json`` that `calm models install` writes into a folder
    converted from a packaged GGUF."""
    text = str(spec)
    if text in PACKAGED_MODELS or (Path(text).suffix == ".gguf" and Path(text).is_file()):
        return text
    record = Path(folder) / "calm_source.json"
    if record.is_file():
        try:
            name = json.loads(record.read_text()).get("name")
        except (OSError, ValueError, AttributeError):
            return None
        if name in PACKAGED_MODELS:
            return name
    return None


@contextlib.contextmanager
def source_gguf(spec, scratch: Path) -> Iterator[Path]:
    """The original GGUF file of ``spec``: a ``.gguf`` path, or a packaged model's file in
    its installed package (a chunked one is assembled into ``scratch`` and removed after)."""
    text = str(spec)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        yield path
        return
    if text in PACKAGED_MODELS:
        entry = PACKAGED_MODELS[text]
        spec_found = importlib.util.find_spec(entry.module)
        if spec_found is None or not spec_found.submodule_search_locations:
            raise ModelSourceError(f"{text} is not installed; run `calm models install {text}`")
        folder = Path(list(spec_found.submodule_search_locations)[0])
        if not entry.assembled:
            gguf_path = folder / entry.gguf_file
            if not gguf_path.is_file():
                raise ModelSourceError(f"{_name(gguf_path)} is missing from the installed package; "
                                       f"run `calm models install {text} --reinstall`")
            yield gguf_path
            return
        staging = Path(tempfile.mkdtemp(prefix=".calm-gguf-source-", dir=scratch))
        try:
            module = importlib.import_module(entry.module)
            try:
                assembled = Path(module.assemble(staging / entry.gguf_file, overwrite=True))
            except (OSError, ValueError) as exc:
                raise ModelSourceError(f"could not assemble {entry.gguf_file} ({exc}); run "
                                       f"`calm models install {text} --reinstall`") from None
            yield assembled
        finally:
            for child in staging.iterdir():
                child.unlink(missing_ok=True)
            staging.rmdir()
        return
    if path.is_dir():
        raise ModelSourceError(f"{_name(path)} is a model folder; --format gguf copies a GGUF "
                               "model's tensors: pass its .gguf file (convert a transformers "
                               "folder with llama.cpp's convert_hf_to_gguf.py), or export "
                               "--format hf")
    raise ModelSourceError(f"--format gguf needs a GGUF model: {show_name(text)} is neither a "
                           ".gguf file nor a packaged name ("
                           f"{', '.join(sorted(PACKAGED_MODELS))})")


def _name(path) -> str:
    """A file name for a message: as it is when printable, else escaped (one line)."""
    return show_name(str(path))


@dataclass
class SourceTensor:
    """One tensor of a source file: the names ``gguf.ReaderTensor`` uses, its data a view
    of the file's memory map (nothing read until used)."""

    name: str
    shape: tuple[int, ...]  # ne0 first, as GGUF stores them
    tensor_type: object  # gguf.GGMLQuantizationType
    n_bytes: int
    data_offset: int  # absolute offset in the file
    file: np.ndarray = field(repr=False)

    @property
    def raw(self) -> np.ndarray:
        """The tensor's bytes (uint8, a view of the map)."""
        return self.file[self.data_offset:self.data_offset + self.n_bytes]

    @property
    def data(self) -> np.ndarray:
        """As ``gguf.GGUFReader`` shapes it: numpy order (ne0 last), typed where the type
        stores one value per element, else uint8 blocks (``ne0 / block * block bytes``)."""
        from gguf import GGML_QUANT_SIZES

        dims = [int(d) for d in reversed(self.shape)]
        plain = _PLAIN_TYPES.get(self.tensor_type.name)
        if plain is not None:
            return self.raw.view(plain).reshape(dims)
        block, type_size = GGML_QUANT_SIZES[self.tensor_type]
        return self.raw.reshape(*dims[:-1], dims[-1] // block * type_size)


@dataclass
class GGUFSource:
    """A source GGUF file: its layout, its tensors and its key/value pairs' exact bytes."""

    path: Path
    layout: GGUFLayout
    file: np.ndarray = field(repr=False)  # the whole file, memory-mapped (uint8)
    tensor_list: list[SourceTensor] = field(default_factory=list)
    #: key -> the exact bytes of that key/value pair in the source, in file order
    kv_bytes: dict[str, bytes] = field(default_factory=dict)

    @property
    def version(self) -> int:
        return self.layout.version

    @property
    def alignment(self) -> int:
        return self.layout.alignment

    @property
    def architecture(self) -> str:
        return self.string("general.architecture") or "?"

    def key(self, key: str) -> GGUFKey | None:
        return self.layout.keys.get(key)

    def value(self, key: str):
        """A scalar or string key's value (``None`` when absent, an array or not UTF-8)."""
        found = self.key(key)
        if found is None or found.kind == _ARRAY:
            return None
        if found.kind != _STRING:
            return found.value
        length = int(self.file[found.value_at:found.value_at + 8].view("<u8")[0])
        start = found.value_at + 8
        try:
            return bytes(self.file[start:start + length]).decode("utf-8")
        except UnicodeDecodeError:
            return None

    def string(self, key: str) -> str | None:
        value = self.value(key)
        return value if isinstance(value, str) else None

    def array_length(self, key: str) -> int | None:
        found = self.key(key)
        return None if found is None or found.kind != _ARRAY else found.count

    def tensors(self) -> dict:
        return {t.name: t for t in self.tensor_list}


def open_source(path: Path) -> GGUFSource:
    """Read a GGUF file's header, keys and tensor infos (the data stays memory-mapped);
    anything calm cannot take is one :class:`ArtifactError` line. The header is walked with
    every count bounded (:func:`~calm_runtime.formats.gguf_layout.read_gguf_layout`);
    nothing is built per item of an array, so a vocabulary of 10^6 strings costs its bytes
    once, not an object each."""
    gguf = require_gguf()
    require_regular_file(path)  # a FIFO or a device would block the read below
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ArtifactError(f"cannot read {_name(path)} ({exc.strerror or exc}); "
                            "check the path") from None
    if magic != _MAGIC:
        raise ArtifactError(f"{_name(path)} is not a GGUF file (it starts with "
                            f"{magic!r}, not b'GGUF'); pass a .gguf model")
    layout = read_gguf_layout(path)
    if layout.order != "<":
        raise ArtifactError(f"{_name(path)} is a big-endian GGUF; calm writes "
                            "little-endian files only: use the little-endian original")
    if layout.version not in (2, 3):
        raise ArtifactError(f"{_name(path)} is GGUF version {layout.version}; calm copies "
                            "versions 2 and 3: re-convert it with a current llama.cpp")
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"cannot map {_name(path)} ({exc}); check the file") from None
    tensors = [SourceTensor(t.name, t.dims, gguf.GGMLQuantizationType(t.kind), t.n_bytes,
                            layout.data_start + t.offset, data) for t in layout.tensors]
    kv_bytes = {name: bytes(data[key.start:key.end]) for name, key in layout.keys.items()}
    return GGUFSource(path=path, layout=layout, file=data, tensor_list=tensors,
                      kv_bytes=kv_bytes)


#: quantised block types whose values are linear in their float16 fields (ggml-common.h):
#: ``x = d * f(q)``, ``+ m`` (Q4_1, Q5_1) or ``- dmin * g(scales)`` (K-quants). Multiplying
#: those fields by ``s`` multiplies every value of the block by ``s``, the quantised values
#: and sub-block scales untouched. Type -> (block bytes, offsets of the float16 fields).
BLOCK_SCALES = {"Q4_0": (18, (0,)), "Q4_1": (20, (0, 2)), "Q5_0": (22, (0,)),
                "Q5_1": (24, (0, 2)), "Q8_0": (34, (0,)), "Q2_K": (84, (80, 82)),
                "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)),
                "Q6_K": (210, (208,))}


def rescale_rows(data: np.ndarray, type_name: str, scale: np.ndarray) -> np.ndarray:
    """A copy of the quantised rows ``data`` (``[rows, row bytes]`` uint8, one GGUF row per
    vocabulary entry) with row ``r``'s values multiplied by ``scale[r]`` through the block
    float16 fields (rounded to float16; one that overflows becomes inf, which the caller's
    error check catches)."""
    size, offsets = BLOCK_SCALES[type_name]
    rows = data.shape[0]
    blocks = np.array(data, dtype=np.uint8).reshape(rows, -1, size)
    factor = np.asarray(scale, dtype=np.float64).reshape(rows, 1)
    for offset in offsets:
        field = blocks[:, :, offset:offset + 2].copy().view(np.float16)[..., 0]
        with np.errstate(over="ignore"):
            scaled = (field.astype(np.float64) * factor).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scaled[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def _string(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def float32_problem(value: float) -> str | None:
    """Why ``value`` cannot be written as a float32 that reads back as it (``None`` when it
    can): not finite, beyond float32's range, or so small it would become subnormal or 0."""
    if not math.isfinite(value):
        return "not finite"
    if abs(value) > float(np.finfo(np.float32).max):
        return "beyond float32's range (3.4e38)"
    if value != 0.0 and abs(value) < float(np.finfo(np.float32).tiny):
        return "below float32's smallest normal number (1.2e-38)"
    return None


def encode_kv(key: str, value) -> bytes:
    """One key/value pair: a ``str``, ``bool``, ``int`` (uint32) or ``float`` (float32); a
    number those types cannot hold is one :class:`ArtifactError` line naming the key."""
    if isinstance(value, bool):
        body = struct.pack("<IB", _BOOL, int(value))
    elif isinstance(value, int):
        if not 0 <= value < 1 << 32:
            raise ArtifactError(f"{key} is {value}, which a uint32 cannot hold; nothing was "
                                "written")
        body = struct.pack("<II", _UINT32, value)
    elif isinstance(value, float):
        problem = float32_problem(value)
        if problem is not None:
            raise ArtifactError(f"{key} is {value!r}, {problem}, so it cannot be written as "
                                "float32; nothing was written")
        body = struct.pack("<If", _FLOAT32, value)
    elif isinstance(value, str):
        body = struct.pack("<I", _STRING) + _string(value)
    else:
        raise TypeError(f"cannot encode {type(value).__name__} for {key}")
    return _string(key) + body


@dataclass
class TensorOut:
    """A tensor of the file being written: its info and where its bytes come from (a byte
    run of the source file, or an array calm computed)."""

    name: str
    dims: tuple[int, ...]  # ne0 first, as GGUF stores them
    ggml_type: int
    n_bytes: int
    source_offset: int | None = None  # absolute offset in the source file
    array: np.ndarray | None = None


def _pad(size: int, alignment: int) -> int:
    return (alignment - size % alignment) % alignment


def _write_zeros(handle, count: int) -> None:
    """``count`` zero bytes, written from one small block (never one object of ``count``)."""
    while count > 0:
        step = min(count, len(_ZEROS))
        handle.write(_ZEROS[:step] if step < len(_ZEROS) else _ZEROS)
        count -= step


def write_gguf(handle, *, version: int, alignment: int, kv: Iterable[bytes],
               tensors: list[TensorOut], source_path: Path,
               progress: Callable[[int], None] | None = None) -> None:
    """Write a GGUF file to the open binary ``handle``: the key/value byte runs in order,
    then the tensors (infos, then aligned data; a source tensor copied from ``source_path``
    byte for byte)."""
    kv = list(kv)
    handle.write(_MAGIC + struct.pack("<IQQ", version, len(tensors), len(kv)))
    for pair in kv:
        handle.write(pair)
    offset = 0
    for tensor in tensors:
        offset += _pad(offset, alignment)
        handle.write(_string(tensor.name) + struct.pack("<I", len(tensor.dims))
                     + struct.pack(f"<{len(tensor.dims)}Q", *tensor.dims)
                     + struct.pack("<IQ", tensor.ggml_type, offset))
        offset += tensor.n_bytes
    _write_zeros(handle, _pad(handle.tell(), alignment))
    start = handle.tell()
    with open(source_path, "rb") as source:
        for tensor in tensors:
            _write_zeros(handle, _pad(handle.tell() - start, alignment))
            if tensor.array is not None:
                data = np.ascontiguousarray(tensor.array).tobytes()
                if len(data) != tensor.n_bytes:
                    raise ArtifactError(f"{tensor.name}: {len(data)} bytes computed, "
                                        f"{tensor.n_bytes} declared; this is a calm bug")
                handle.write(data)
            else:
                source.seek(tensor.source_offset)
                left = tensor.n_bytes
                while left:
                    block = source.read(min(left, _COPY_CHUNK))
                    if not block:
                        raise ArtifactError(f"{_name(source_path)} ends inside "
                                            f"{tensor.name}; the source file is truncated")
                    handle.write(block)
                    left -= len(block)
            if progress is not None:
                progress(tensor.n_bytes)
    handle.flush()
    os.fsync(handle.fileno())


def verify_copy(path: Path, source: GGUFSource, tensors: list[TensorOut], computed: dict,
                rewritten: tuple[str, ...] = ()) -> None:
    """Re-read a file :func:`write_gguf` wrote: the tensor list as planned, every copied
    tensor's bytes equal to the source's, every computed one's equal to ``computed[name]``,
    every source key's bytes kept (keys ending in one of ``rewritten`` excepted)."""
    written = open_source(path)
    new, old = written.tensors(), source.tensors()
    if [t.name for t in written.tensor_list] != [t.name for t in tensors]:
        raise ArtifactError(f"{_name(path.name)} does not list the planned tensors; this is "
                            "a calm bug (nothing was written)")
    for tensor in tensors:
        got = new[tensor.name]
        data = got.raw
        if tensor.array is None:
            same = _same_bytes(data, old[tensor.name].raw)
        else:
            same = data.tobytes() == np.ascontiguousarray(computed[tensor.name]).tobytes()
        if not same:
            raise ArtifactError(f"{tensor.name} reads back differently from what was written; "
                                "check the disk (nothing was written)")
    changed = [k for k, raw in source.kv_bytes.items() if written.kv_bytes.get(k) != raw
               and not k.endswith(rewritten)]
    if changed:
        raise ArtifactError(f"the key {changed[0]} reads back changed; this is a calm bug "
                            "(nothing was written)")


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Two byte runs compared in chunks (no comparison array the size of a tensor)."""
    if a.shape != b.shape:
        return False
    return all(np.array_equal(a[i:i + _COPY_CHUNK], b[i:i + _COPY_CHUNK])
               for i in range(0, a.shape[0], _COPY_CHUNK))
