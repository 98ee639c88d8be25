"""GGUF files are checked against their size before any reader trusts their counts
(calm_runtime.formats.gguf_layout): a hostile or truncated file is one ArtifactError line,
fast and in bounded memory, on the export route and on the transformers route."""

from __future__ import annotations

import os
import struct
import time
import tracemalloc

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from calm_runtime.errors import ArtifactError  # noqa: E402
from calm_runtime.formats.gguf_layout import (  # noqa: E402
    MAX_ARRAY_ITEMS,
    check_gguf_layout,
)


def _header(n_tensors: int, n_keys: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_keys)


def _key(name: str) -> bytes:
    data = name.encode()
    return struct.pack("<Q", len(data)) + data


def huge_array_file(path, items: int = 10 ** 9, pad: int = 300):
    """The probe's file: one key whose uint8 array declares ``items`` items, cut short."""
    body = _header(0, 1) + _key("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 0, items)
    path.write_bytes(body + b"\0" * (pad - len(body) + 52))
    return path


def tiny_gguf(path):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.context_length", 64)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_tensor("output.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _refused(path, match: str) -> float:
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ArtifactError, match=match) as info:
            check_gguf_layout(path)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    seconds = time.perf_counter() - started
    assert "\n" not in str(info.value)
    assert peak < 16 * 2 ** 20, f"peak {peak:,} bytes"
    return seconds


def test_a_352_byte_file_declaring_a_billion_items_is_refused_at_once(tmp_path):
    path = huge_array_file(tmp_path / "huge.gguf")
    assert path.stat().st_size == 352
    assert _refused(path, "declares 1,000,000,000 items") < 1.0


def test_a_genuine_looking_file_with_twenty_million_items_is_refused(tmp_path):
    items = 2 * 10 ** 7
    path = tmp_path / "big.gguf"
    body = _header(0, 1) + _key("tokenizer.ggml.token_type") + struct.pack("<IIQ", 9, 0, items)
    with open(path, "wb") as handle:
        handle.write(body)
        handle.truncate(len(body) + items)  # every declared byte is there
    assert items > MAX_ARRAY_ITEMS
    assert _refused(path, f"more than {MAX_ARRAY_ITEMS:,}") < 1.0


def test_a_valid_file_passes_and_every_truncation_of_it_is_one_line(tmp_path):
    path = tiny_gguf(tmp_path / "ok.gguf")
    check_gguf_layout(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for size in range(0, len(data), 7):
        cut.write_bytes(data[:size])
        with pytest.raises(ArtifactError):
            check_gguf_layout(cut)


@pytest.mark.parametrize("case, match", [
    ("zero_width", "no elements"),
    ("bad_type", "which ggml does not define"),
    ("outside", "lies outside"),
    ("long_string", "declares"),
    ("dims", "dimensions"),
    ("nested", "nests arrays deeper"),
])
def test_each_declared_count_is_checked(tmp_path, case, match):
    tensor = {"zero_width": ([0, 300], 0, 0), "bad_type": ([32, 2], 99, 0),
              "outside": ([32, 2], 0, 4096)}
    if case in tensor:
        dims, kind, offset = tensor[case]
        info = _key("output.weight") + struct.pack("<I", len(dims)) + \
            struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", kind, offset)
        body = _header(1, 0) + info
    elif case == "long_string":
        body = _header(0, 1) + struct.pack("<Q", 2 ** 40) + b"x" * 64
    elif case == "dims":
        body = _header(1, 0) + _key("w") + struct.pack("<I", 9) + b"\0" * 96
    else:  # an array of arrays of arrays
        body = _header(0, 1) + _key("a") + struct.pack("<IIQIQ", 9, 9, 1, 9, 1) + b"\0" * 64
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(body + b"\0" * 256)
    _refused(path, match)


def test_special_files_are_refused_without_opening_them(tmp_path):
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ArtifactError, match="not a regular file"):
        check_gguf_layout(fifo)


@pytest.mark.parametrize("argv", [
    ["--format", "gguf"],  # the export route (gguf's reader)
    [],                    # the transformers route (ONNX)
])
def test_both_export_routes_give_one_line(tmp_path, capsys, argv, tiny_llama_tied):
    pytest.importorskip("torch")
    from conftest import random_calibration_adapter

    from calm_export.cli import main

    random_calibration_adapter(tiny_llama_tied).save_pretrained(tmp_path / "adapter")
    path = huge_array_file(tmp_path / "huge.gguf")
    out = tmp_path / ("out.gguf" if argv else "out")
    code = main(["--model", str(path), "--out", str(out), "--adapter", str(tmp_path / "adapter"),
                 "-q", *argv])
    captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    assert captured.err.count("\n") == 1 and "ArtifactError" in captured.err, captured.err
    assert not out.exists()
