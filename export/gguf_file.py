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

Reading uses the ``gguf`` package (llama.cpp's own reader, in the train extra).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from calm_runtime.data.models import PACKAGED_MODELS
from calm_runtime.errors import ArtifactError, BackendUnavailableError, ModelSourceError
from calm_runtime.files import show_name
from calm_runtime.formats.gguf_layout import check_gguf_layout, require_regular_file

__all__ = ["BLOCK_SCALES", "GGUFSource", "TensorOut", "encode_kv", "gguf_origin", "open_source",
           "require_gguf",
           "rescale_rows", "source_gguf", "verify_copy", "write_gguf"]

#: GGUF value types (the GGUF specification): the ones calm writes
_UINT32, _FLOAT32, _BOOL, _STRING = 4, 6, 7, 8
_MAGIC = b"GGUF"
_COPY_CHUNK = 1 << 24


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
                raise ModelSourceError(f"{gguf_path} is missing from the installed package; "
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
        raise ModelSourceError(f"{path} is a model folder; --format gguf copies a GGUF "
                               "model's tensors: pass its .gguf file (convert a transformers "
                               "folder with llama.cpp's convert_hf_to_gguf.py), or export "
                               "--format hf")
    raise ModelSourceError(f"--format gguf needs a GGUF model: {show_name(text)} is neither a "
                           ".gguf file nor a packaged name ("
                           f"{', '.join(sorted(PACKAGED_MODELS))})")


@dataclass
class GGUFSource:
    """A source GGUF file as read by ``gguf.GGUFReader``, with its exact byte runs."""

    path: Path
    reader: object
    version: int
    alignment: int
    #: key -> the exact bytes of that key/value pair in the source, in file order
    kv_bytes: dict[str, bytes]

    @property
    def architecture(self) -> str:
        return self.string("general.architecture") or "?"

    def field(self, key: str):
        return self.reader.fields.get(key)

    def value(self, key: str):
        """A scalar or string key's value (``None`` when absent or an array)."""
        field = self.field(key)
        if field is None or len(field.types) != 1:
            return None
        try:
            return field.contents()
        except (UnicodeDecodeError, ValueError, IndexError):
            return None

    def string(self, key: str) -> str | None:
        value = self.value(key)
        return value if isinstance(value, str) else None

    def array_length(self, key: str) -> int | None:
        field = self.field(key)
        return None if field is None or len(field.types) < 2 else len(field.data)

    def tensors(self) -> dict:
        return {t.name: t for t in self.reader.tensors}


def open_source(path: Path) -> GGUFSource:
    """Read a GGUF file's header, keys and tensor infos (the data stays memory-mapped);
    anything the reader cannot take is one :class:`ArtifactError` line."""
    gguf = require_gguf()
    require_regular_file(path)  # a FIFO or a device would block the read below
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ArtifactError(f"cannot read {show_name(str(path))} ({exc.strerror or exc}); "
                            "check the path") from None
    if magic != _MAGIC:
        raise ArtifactError(f"{show_name(str(path))} is not a GGUF file (it starts with "
                            f"{magic!r}, not b'GGUF'); pass a .gguf model")
    # gguf's reader believes the counts a file declares: check them against its size first
    check_gguf_layout(path)
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except (ValueError, KeyError, IndexError, OSError, struct.error) as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise ArtifactError(f"gguf cannot read {show_name(str(path))} ({reason}); check the "
                            "file, or re-convert it with a current llama.cpp") from None
    if reader.byte_order != "I":
        raise ArtifactError(f"{show_name(str(path))} is a big-endian GGUF; calm writes "
                            "little-endian files only: use the little-endian original")
    version = int(reader.fields["GGUF.version"].parts[-1][0])
    if version not in (2, 3):
        raise ArtifactError(f"{show_name(str(path))} is GGUF version {version}; calm copies "
                            "versions 2 and 3: re-convert it with a current llama.cpp")
    kv_bytes = {name: b"".join(bytes(part) for part in field.parts)
                for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return GGUFSource(path=path, reader=reader, version=version,
                      alignment=int(reader.alignment), kv_bytes=kv_bytes)


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


def encode_kv(key: str, value) -> bytes:
    """One key/value pair: a ``str``, ``bool``, ``int`` (uint32) or ``float`` (float32)."""
    if isinstance(value, bool):
        body = struct.pack("<IB", _BOOL, int(value))
    elif isinstance(value, int):
        body = struct.pack("<II", _UINT32, value)
    elif isinstance(value, float):
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
    handle.write(b"\0" * _pad(handle.tell(), alignment))
    start = handle.tell()
    with open(source_path, "rb") as source:
        for tensor in tensors:
            handle.write(b"\0" * _pad(handle.tell() - start, alignment))
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
                        raise ArtifactError(f"{show_name(str(source_path))} ends inside "
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
    if [t.name for t in written.reader.tensors] != [t.name for t in tensors]:
        raise ArtifactError(f"{path.name} does not list the planned tensors; this is a calm "
                            "bug (nothing was written)")
    for tensor in tensors:
        got = new[tensor.name]
        data = written.reader.data[got.data_offset:got.data_offset + got.n_bytes]
        if tensor.array is None:
            src = old[tensor.name]
            same = np.array_equal(data, source.reader.data[
                src.data_offset:src.data_offset + src.n_bytes])
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
