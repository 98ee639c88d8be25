"""A GGUF file's layout checked against its size before any reader trusts it.

The ``gguf`` package's reader (and transformers' GGUF loader, which uses it) believes the
counts a file declares: a 352-byte file that declares a metadata array of 10^9 items makes it
allocate without bound. :func:`check_gguf_layout` walks the header itself — every key,
string and array length, every tensor's shape, type, offset and extent — and checks each
against the bytes the file actually has and against the named bounds below, reading the
header through a memory map (nothing is allocated per declared item). A violation is one
:class:`~calm_runtime.errors.ArtifactError` line, in well under a second for any file.

Every count is bounded twice before anything is read per item: by a named cap below and by
what the file's bytes can hold (a key takes at least 13 bytes, a tensor's info 32, a string
8), so a small or sparse file cannot drive the allocations of a reader that builds an object
per item. :func:`read_gguf_layout` returns what the walk found (each key's byte run and
scalar value, each tensor's shape, type and extent), which calm's own GGUF reader
(export/gguf_file.py) uses instead of building an object per array item.

Format (GGUF v1–v3, little- or big-endian): ``GGUF``, version (u32), tensor count and key
count (u64; u32 in v1), the key/value pairs, the tensor infos (name, dims, type, offset),
then the data, aligned to ``general.alignment`` (32 when absent).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from calm_runtime.errors import ArtifactError
from calm_runtime.files import show_name

__all__ = ["MAX_ALIGNMENT", "MAX_ARRAY_ITEMS", "MAX_DIMS", "MAX_KEYS", "MAX_NESTING",
           "MAX_STRING_ITEMS", "MAX_TENSORS", "MAX_STRING_BYTES", "GGUFKey", "GGUFLayout",
           "GGUFTensorInfo", "check_gguf_layout", "read_gguf_layout", "require_regular_file"]

#: key/value pairs a file may declare (llama.cpp's models hold a few dozen)
MAX_KEYS = 1 << 16
#: tensors a file may declare (a 405B model has about 1,100; a mixture of experts with its
#: experts stored one by one some 10^4)
MAX_TENSORS = 1 << 16
#: items of one metadata array (the largest vocabularies and merge lists hold ~10^6)
MAX_ARRAY_ITEMS = 1 << 23
#: strings in all the metadata arrays of a file together (the largest vocabulary and merge
#: list of a released model hold about 6.5 x 10^5); gguf's own reader builds several
#: objects per string, about 1 kB each
MAX_STRING_ITEMS = 1 << 20
#: the largest ``general.alignment`` (llama.cpp writes 32; a larger one only pads the file,
#: and every tensor of a copy is padded to it)
MAX_ALIGNMENT = 1 << 16
#: bytes of one string (a chat template is a few kB; a key is a short name)
MAX_STRING_BYTES = 1 << 24
#: dimensions of one tensor (ggml's GGML_MAX_DIMS)
MAX_DIMS = 4
#: arrays inside arrays (GGUF allows them; no model uses more than one level)
MAX_NESTING = 2

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
#: the fewest bytes a key/value pair (key length, type, a one-byte value) and a tensor info
#: (name length, n_dims, one dimension, type, offset) take
_MIN_KEY_BYTES, _MIN_TENSOR_BYTES = 13, 32
#: value type -> struct code of the fixed-size types (GGUF spec)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}


@dataclass(frozen=True)
class GGUFKey:
    """One key/value pair: its value type, its byte run ``[start, end)`` in the file, where
    its value starts, its value (scalars only) and, for an array, its item type and count."""

    name: str
    kind: int
    start: int
    end: int
    value_at: int
    value: object = None
    item_kind: int | None = None
    count: int | None = None


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor: dimensions (ne0 first, as stored), ggml type, offset in the data section
    and size in bytes."""

    name: str
    dims: tuple[int, ...]
    kind: int
    offset: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFLayout:
    """What :func:`read_gguf_layout` found: every key and tensor, in file order."""

    version: int
    order: str  # "<" little-endian, ">" big-endian
    alignment: int
    data_start: int
    size: int
    keys: dict[str, GGUFKey]
    tensors: tuple[GGUFTensorInfo, ...]


class _Walk:
    """A bounded cursor over the mapped file."""

    def __init__(self, data, size: int, order: str, where: str) -> None:
        self.data, self.size, self.order, self.where, self.at = data, size, order, where, 0
        self.strings = 0  # string items of all arrays so far
        self.last_array: tuple[int, int] | None = None  # (item type, count) of the last value

    def fail(self, what: str, fix: str = "the file is truncated or not a GGUF model: "
             "re-download or re-convert it"):
        raise ArtifactError(f"{self.where}: {what}; {fix}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.at + n > self.size:
            self.fail(f"{what} needs {n:,} bytes at offset {self.at:,} but the file has "
                      f"{self.size:,}")

    def scalar(self, code: str, what: str):
        width = struct.calcsize(code)
        self.need(width, what)
        value = struct.unpack_from(self.order + code, self.data, self.at)[0]
        self.at += width
        return value

    def string(self, what: str, *, decode: bool = False):
        length = self.scalar("Q", f"the length of {what}")
        if length > MAX_STRING_BYTES:
            self.fail(f"{what} declares {length:,} bytes (more than {MAX_STRING_BYTES:,})")
        self.need(length, what)
        start, self.at = self.at, self.at + length
        if not decode:
            return None
        try:
            return bytes(self.data[start:self.at]).decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8")

    def _strings(self, count: int, what: str) -> None:
        length = struct.Struct(self.order + "Q").unpack_from
        data, size, at = self.data, self.size, self.at
        for i in range(count):
            if at + 8 > size:
                self.at = at
                self.need(8, f"the length of item {i} of {what}")
            n = length(data, at)[0]
            at += 8
            if n > MAX_STRING_BYTES or at + n > size:
                self.at = at
                if n > MAX_STRING_BYTES:
                    self.fail(f"item {i} of {what} declares {n:,} bytes (more than "
                              f"{MAX_STRING_BYTES:,})")
                self.need(n, f"item {i} of {what}")
            at += n
        self.at = at

    def value(self, kind: int, what: str, depth: int = 0):
        """Skip (or, for scalars, read) one value of type ``kind``."""
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind != _ARRAY:
            self.fail(f"{what} has value type {kind}, which GGUF does not define")
        if depth >= MAX_NESTING:
            self.fail(f"{what} nests arrays deeper than {MAX_NESTING}")
        item = self.scalar("I", f"the item type of {what}")
        count = self.scalar("Q", f"the item count of {what}")
        if depth == 0:
            self.last_array = (item, count)
        if count > MAX_ARRAY_ITEMS:
            self.fail(f"{what} declares {count:,} items (more than {MAX_ARRAY_ITEMS:,})")
        if item in _SCALARS:
            self.need(count * struct.calcsize(_SCALARS[item]), f"{what} ({count:,} items)")
            self.at += count * struct.calcsize(_SCALARS[item])
            return None
        # strings and arrays take at least 8 bytes each: a count the rest of the file
        # cannot hold is refused before walking any item
        self.need(count * 8, f"{what} ({count:,} items)")
        if item == _STRING:  # a vocabulary: hundreds of thousands, walked in one tight loop
            self.strings += count
            if self.strings > MAX_STRING_ITEMS:
                self.fail(f"its arrays hold more than {MAX_STRING_ITEMS:,} strings ({what} "
                          f"brings them to {self.strings:,})")
            self._strings(count, what)
            return None
        for i in range(count):
            self.value(item, f"item {i} of {what}", depth + 1)
        return None


def require_regular_file(path: str | os.PathLike) -> None:
    """A one-line :class:`ArtifactError` unless ``path`` is a regular file (a FIFO or a
    device would block or never end a read), checked without opening it."""
    import stat

    where = show_name(str(path))
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ArtifactError(f"cannot read {where} ({exc.strerror or exc}); check the "
                            "path") from None
    if not stat.S_ISREG(mode):
        raise ArtifactError(f"{where} is not a regular file (a FIFO, device or folder); pass "
                            "a .gguf file")


def check_gguf_layout(path: str | os.PathLike) -> None:
    """Check the GGUF file ``path`` against its size and the bounds above (see the module's
    docstring); one :class:`ArtifactError` line on any violation."""
    read_gguf_layout(path)


def read_gguf_layout(path: str | os.PathLike) -> GGUFLayout:
    """:func:`check_gguf_layout`, returning the :class:`GGUFLayout` it walked."""
    path = Path(path)
    where = show_name(str(path))
    require_regular_file(path)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 24:
                raise ArtifactError(f"{where} has {size} bytes, fewer than a GGUF header; pass "
                                    "a .gguf model")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _check(data, size, where)
    except OSError as exc:
        raise ArtifactError(f"cannot read {where} ({exc.strerror or exc}); check the "
                            "path") from None


def _check(data, size: int, where: str) -> GGUFLayout:
    if bytes(data[:4]) != _MAGIC:
        raise ArtifactError(f"{where} is not a GGUF file (it starts with {bytes(data[:4])!r}, "
                            "not b'GGUF'); pass a .gguf model")
    version = struct.unpack_from("<I", data, 4)[0]
    order = "<"
    if version & 0xFFFF == 0:  # written on a big-endian host
        order, version = ">", struct.unpack_from(">I", data, 4)[0]
    if version not in (1, 2, 3):
        raise ArtifactError(f"{where} is GGUF version {version}; versions 1 to 3 are read: "
                            "re-convert it with a current llama.cpp")
    walk = _Walk(data, size, order, where)
    walk.at = 8
    count_code = "I" if version == 1 else "Q"
    n_tensors = walk.scalar(count_code, "the tensor count")
    n_keys = walk.scalar(count_code, "the key count")
    if n_tensors > MAX_TENSORS:
        walk.fail(f"it declares {n_tensors:,} tensors (more than {MAX_TENSORS:,})")
    if n_keys > MAX_KEYS:
        walk.fail(f"it declares {n_keys:,} keys (more than {MAX_KEYS:,})")
    rest = size - walk.at
    if n_keys * _MIN_KEY_BYTES + n_tensors * _MIN_TENSOR_BYTES > rest:
        walk.fail(f"it declares {n_tensors:,} tensors and {n_keys:,} keys, more than the "
                  f"{rest:,} bytes after its header can describe ({_MIN_TENSOR_BYTES} and "
                  f"{_MIN_KEY_BYTES} bytes each at least)")
    alignment = 32
    keys: dict[str, GGUFKey] = {}
    for k in range(n_keys):
        start = walk.at
        key = walk.string(f"key {k}", decode=True)
        if key in keys:
            walk.fail(f"the key {key!r} appears twice")
        kind = walk.scalar("I", f"the value type of key {key!r}")
        value_at, walk.last_array = walk.at, None
        value = walk.value(kind, f"the value of key {key!r}")
        if key == "general.alignment":
            if kind != 4 or not value or value & (value - 1):
                walk.fail(f"general.alignment is {value!r}, not a power of two (uint32)")
            if value > MAX_ALIGNMENT:
                walk.fail(f"general.alignment is {value:,}; at most {MAX_ALIGNMENT:,} is "
                          "accepted (a larger one only pads the file)",
                          "re-convert the model with llama.cpp, which writes 32")
            alignment = value
        item_kind, count = walk.last_array if kind == _ARRAY else (None, None)
        keys[key] = GGUFKey(key, kind, start, walk.at, value_at, value, item_kind, count)
    tensors = []
    names: set[str] = set()
    for t in range(n_tensors):
        name = walk.string(f"the name of tensor {t}", decode=True)
        if name in names:
            walk.fail(f"the tensor {name!r} appears twice")
        names.add(name)
        n_dims = walk.scalar("I", f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            walk.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} are allowed)")
        dims = [walk.scalar("Q", f"a dimension of tensor {name!r}") for _ in range(n_dims)]
        kind = walk.scalar("I", f"the type of tensor {name!r}")
        offset = walk.scalar("Q", f"the data offset of tensor {name!r}")
        tensors.append((name, dims, kind, offset))
    start = -(-walk.at // alignment) * alignment
    infos = _check_extents(tensors, start, size, alignment, walk)
    return GGUFLayout(version, order, alignment, start, size, keys, infos)


def _check_extents(tensors, start: int, size: int, alignment: int,
                   walk: _Walk) -> tuple[GGUFTensorInfo, ...]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    room = size - start
    infos = []
    for name, dims, kind, offset in tensors:
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            walk.fail(f"tensor {name!r} has type {kind}, which ggml does not define")
        elements = 1
        for d in dims:
            elements *= d
        if elements == 0:
            walk.fail(f"tensor {name!r} has shape {dims}: no elements")
        if dims[0] % block:
            walk.fail(f"tensor {name!r} has shape {dims}: its first dimension is not a "
                      f"multiple of its type's block of {block}")
        n_bytes = elements // block * block_bytes
        if offset % alignment or offset + n_bytes > room:
            walk.fail(f"tensor {name!r} ({n_bytes:,} bytes at data offset {offset:,}) lies "
                      f"outside the {max(room, 0):,} data bytes or off the {alignment}-byte "
                      "alignment")
        infos.append(GGUFTensorInfo(name, tuple(dims), kind, offset, n_bytes))
    return tuple(infos)
