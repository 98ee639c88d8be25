"""Rotary tables written as the graph that computes them (export/rotary.py): a builder-style
table (float32 ``cos(t f) m``) is replaced by nodes ONNX Runtime folds back into the same
table (within the tolerance) and the graph's outputs stay the same; a table that is not of
that form stays, with the reason."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from calm_export.rotary import TOLERANCE, compact_rotary_caches  # noqa: E402

LENGTH, DIM = 4096, 32


def _tables(theta=10000.0, scale=1.0):
    """The builder's way: float32 inverse frequencies, a float32 outer product, cos/sin."""
    freq = (1.0 / theta ** (np.arange(0, 2 * DIM, 2, dtype=np.int64).astype(np.float32)
                            / (2 * DIM))).astype(np.float32)
    angles = np.outer(np.arange(LENGTH, dtype=np.float32), freq).astype(np.float32)
    return ((np.cos(angles) * np.float32(scale)).astype(np.float32),
            (np.sin(angles) * np.float32(scale)).astype(np.float32))


def _model(cos, sin):
    """positions [n] -> the rows of both tables (as GroupQueryAttention reads them)."""
    nodes = [helper.make_node("Gather", ["cos_cache", "pos"], ["c"]),
             helper.make_node("Gather", ["sin_cache", "pos"], ["s"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("pos", TensorProto.INT64, [None])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, DIM]) for n in ("c", "s")],
        [numpy_helper.from_array(cos, "cos_cache"), numpy_helper.from_array(sin, "sin_cache")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _rows(model, positions):
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(["c", "s"], {"pos": positions})


@pytest.mark.parametrize("scale", [1.0, 0.75])
def test_a_builder_table_becomes_the_nodes_that_compute_it(scale):
    cos, sin = _tables(scale=scale)
    model = _model(cos, sin)
    positions = np.array([0, 1, 7, 1000, LENGTH - 1], np.int64)
    before = _rows(model, positions)
    (record,) = compact_rotary_caches(model)
    assert record["bytes"] == cos.nbytes + sin.nbytes and record["max_abs_diff"] <= TOLERANCE
    onnx.checker.check_model(model)
    names = {i.name for i in model.graph.initializer}
    assert not names & {"cos_cache", "sin_cache"}
    assert sum(i.ByteSize() for i in model.graph.initializer) < 2_000  # a few numbers
    for got, want in zip(_rows(model, positions), before, strict=True):
        assert np.abs(got - want).max() <= TOLERANCE


def test_a_table_of_another_form_stays_with_its_reason():
    cos, sin = _tables()
    noisy = cos.copy()
    noisy[LENGTH // 2:] += np.float32(1e-3)  # not cos(t f) any more
    model = _model(noisy, sin)
    (record,) = compact_rotary_caches(model)
    assert "differs" in record["reason"]
    assert {"cos_cache", "sin_cache"} <= {i.name for i in model.graph.initializer}
    model = _model(cos + 1, sin)  # row 0 is not (m, 0) with m = cos(0) m
    (record,) = compact_rotary_caches(model)
    assert "cos_cache" in {i.name for i in model.graph.initializer} and "reason" in record
