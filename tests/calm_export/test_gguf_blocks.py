"""int4 engines carrying a GGUF's own blocks (export/gguf_blocks.py): every supported GGUF
type decodes to blocks that reproduce gguf's own dequantisation, and a graph's MatMuls
whose weights are GGUF rows (permuted, packed from two tensors, scaled per row) become
MatMulNBits that compute exactly those weights; other weights are left alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from calm_export import gguf_blocks  # noqa: E402
from calm_export.gguf_blocks import carry_gguf_blocks, decode_tensor  # noqa: E402
from calm_export.gguf_file import gguf_origin  # noqa: E402

T = gguf.GGMLQuantizationType
ROWS, COLS = 24, 512  # 512 inputs: two k-quant super-blocks per row


def _random_kquant(qtype, rng):
    """Random k-quant blocks (any bytes are valid blocks) with sane fp16 super-scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (ROWS * COLS // block, size), dtype=np.uint8)
    d = rng.uniform(1e-3, 2e-2, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    if qtype == T.Q6_K:
        raw[:, 208:210] = d
    else:
        raw[:, 0:2] = d
        raw[:, 2:4] = rng.uniform(1e-3, 2e-2, (raw.shape[0], 1)).astype(
            np.float16).view(np.uint8)
    return raw.reshape(ROWS, -1)


def write_gguf(path, tensors):
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (values, qtype) in tensors.items():
        writer.add_tensor(name, values, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path))


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    rng = np.random.default_rng(0)
    tensors = {}
    for qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        values = rng.standard_normal((ROWS, COLS)).astype(np.float32) * 0.1
        tensors[f"{qtype.name}.weight"] = (gguf.quants.quantize(values, qtype), qtype)
    for qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        tensors[f"{qtype.name}.weight"] = (_random_kquant(qtype, rng), qtype)
    return write_gguf(tmp_path_factory.mktemp("gguf") / "blocks.gguf", tensors)


def values_of(reader, name):
    tensor = next(t for t in reader.tensors if t.name == name)
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(ROWS, COLS)


@pytest.mark.parametrize("name", list(gguf_blocks.SUPPORTED))
def test_every_supported_type_decodes_to_blocks_that_reproduce_gguf(reader, name):
    tensor = next(t for t in reader.tensors if t.name == f"{name}.weight")
    blocks, values = decode_tensor(tensor)
    expected = values_of(reader, f"{name}.weight")
    np.testing.assert_array_equal(values, expected)
    rebuilt = blocks.dequantize()
    assert np.abs(rebuilt - expected).max() <= 2e-6 * np.abs(expected).max()
    block, bits, _ = gguf_blocks.SUPPORTED[name]
    assert (blocks.block, blocks.bits) == (block, bits)
    limit = 1 << (bits - 1)
    assert -limit <= blocks.k.min() and blocks.k.max() < limit
    if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):  # types with a block minimum use it
        assert blocks.minimum is not None and np.abs(blocks.minimum).max() > 0


def _graph(weights):
    """X [1, 3, COLS] -> one MatMul per weight [N, COLS] (as ``X @ W.T``), outputs Y0.."""
    nodes, inits, outputs = [], [], []
    for i, w in enumerate(weights):
        inits.append(numpy_helper.from_array(np.ascontiguousarray(w.T), f"W{i}"))
        nodes.append(helper.make_node("MatMul", ["X", f"W{i}"], [f"Y{i}"], name=f"/mm{i}/MatMul"))
        outputs.append(helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT,
                                                     [1, 3, w.shape[0]]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 3, COLS])],
        outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model, x):
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"X": x})


def test_matmuls_of_gguf_rows_carry_those_blocks_exactly(reader, monkeypatch):
    rng = np.random.default_rng(1)
    q41, q80 = values_of(reader, "Q4_1.weight"), values_of(reader, "Q8_0.weight")
    q4k, q6k = values_of(reader, "Q4_K.weight"), values_of(reader, "Q6_K.weight")
    permuted = q41[rng.permutation(ROWS)]  # Llama's q/k rows come back permuted
    packed = np.concatenate([q4k[:8], q6k[8:]])  # the builder's q/k/v: two tensors, one MatMul
    scale = rng.uniform(0.5, 2.0, ROWS).astype(np.float32)
    head = q80 * scale[:, None]  # a calibrated head W / (tau T)
    other = rng.standard_normal((ROWS, COLS)).astype(np.float32)  # not the GGUF's
    weights = [permuted, packed, head, other]
    model = _graph(weights)
    monkeypatch.setattr(gguf_blocks, "ACCURACY_LEVEL", 0)  # fp32 compute: exact to compare
    report = carry_gguf_blocks(model, reader)
    by_node = {r.node: r for r in report}
    assert by_node["/mm0/MatMul"].types == ("Q4_1",) and by_node["/mm0/MatMul"].reason is None
    assert by_node["/mm1/MatMul"].types == ("Q4_K", "Q6_K")
    assert by_node["/mm2/MatMul"].scaled and by_node["/mm2/MatMul"].types == ("Q8_0",)
    assert "not the GGUF's" in by_node["/mm3/MatMul"].reason
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 3
    carried = {n.name: n for n in model.graph.node if n.op_type == "MatMulNBits"}
    bits = {name: next(a.i for a in n.attribute if a.name == "bits")
            for name, n in carried.items()}
    # Q4_1: 4 bits; Q4_K with Q6_K: 8 bits in blocks of 16; Q8_0: 8 bits
    assert bits == {"/mm0/MatMul": 4, "/mm1/MatMul": 8, "/mm2/MatMul": 8}
    onnx.checker.check_model(model)
    x = rng.standard_normal((1, 3, COLS)).astype(np.float32)
    for w, got in zip(weights, _run(model, x), strict=True):
        want = x @ w.T
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_int8_compute_stays_close_and_the_untouched_weight_is_still_a_matmul(reader):
    q41 = values_of(reader, "Q4_1.weight")
    model = _graph([q41])
    report = carry_gguf_blocks(model, reader)
    assert [r.reason for r in report] == [None]
    weights_left = {i.name for i in model.graph.initializer}
    assert "W0" not in weights_left  # the fp32 weight is gone, the blocks replace it
    x = np.random.default_rng(2).standard_normal((1, 3, COLS)).astype(np.float32)
    (got,) = _run(model, x)
    want = x @ q41.T
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()  # int8 activations


def test_the_gguf_a_model_came_from(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    assert gguf_origin(str(folder), folder) is None
    (folder / "calm_source.json").write_text(json.dumps(
        {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "name": "smollm2-135m-instruct"}))
    assert gguf_origin(str(folder), folder) == "smollm2-135m-instruct"
    assert gguf_origin("smollm2-135m-instruct", folder) == "smollm2-135m-instruct"
    (folder / "calm_source.json").write_text(json.dumps({"gguf_file": "x.gguf", "name": "x"}))
    assert gguf_origin(str(folder), folder) is None
    file = tmp_path / "m.gguf"
    file.write_bytes(b"GGUF")
    assert gguf_origin(str(file), folder) == str(file)


def _tied_graph(table, head=None):
    """ids [1, 3] -> Gather of the embedding ``table`` [V, COLS]; X [1, 3, COLS] -> the head.
    ``head`` None: tied, as the builder writes it (the head's ``W^T`` read back through a
    Transpose for the Gather); else an untied head of its own."""
    if head is None:
        inits = [numpy_helper.from_array(np.ascontiguousarray(table.T), "Wt")]
        nodes = [helper.make_node("Transpose", ["Wt"], ["table"], perm=[1, 0], name="/t"),
                 helper.make_node("Gather", ["table", "ids"], ["E"], name="/embed/Gather")]
    else:
        inits = [numpy_helper.from_array(np.ascontiguousarray(head.T), "Wt"),
                 numpy_helper.from_array(table, "table")]
        nodes = [helper.make_node("Gather", ["table", "ids"], ["E"], name="/embed/Gather")]
    nodes.append(helper.make_node("MatMul", ["X", "Wt"], ["Y"], name="/head/MatMul"))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 3, COLS]),
                     helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 3, ROWS]),
         helper.make_tensor_value_info("E", TensorProto.FLOAT, [1, 3, COLS])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("tied", [True, False])
def test_an_embedding_of_gguf_rows_is_gathered_from_the_heads_blocks(reader, monkeypatch, tied):
    """The token embedding becomes GatherBlockQuantized on the GGUF's blocks, sharing the
    head's bytes (tied: the scales too; a calibrated untied head ``W / (tau T)``: the same
    integers, scales of its own); rows come back exactly, the float32 table is gone."""
    rng = np.random.default_rng(3)
    q80 = values_of(reader, "Q8_0.weight")
    scale = None if tied else rng.uniform(0.5, 2.0, ROWS).astype(np.float32)
    model = _tied_graph(q80, None if tied else q80 * scale[:, None])
    monkeypatch.setattr(gguf_blocks, "ACCURACY_LEVEL", 0)
    report = carry_gguf_blocks(model, reader)
    table = [r for r in report if r.embedding]
    assert [(r.node, r.types, r.reason) for r in table] == [("/embed/Gather", ("Q8_0",), None)]
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert "Gather" not in ops and "Transpose" not in ops and ops.count("MatMulNBits") == 1
    gather = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    assert gather.input[0] == head.input[1]  # one copy of the vocabulary's integers
    sizes = {i.name: i.data_type for i in model.graph.initializer}
    assert not any(t == TensorProto.FLOAT and n in ("Wt", "table") for n, t in sizes.items())
    # Q8_0's scales are the GGUF's float16 values: stored as float16, cast at load
    assert [t for n, t in sizes.items() if n.endswith("gguf_scales16")] == (
        [TensorProto.FLOAT16] if tied else [])  # W / (tau T): scales no float16 holds
    ids = rng.integers(0, ROWS, (1, 3)).astype(np.int64)
    x = rng.standard_normal((1, 3, COLS)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    y, e = session.run(["Y", "E"], {"X": x, "ids": ids})
    np.testing.assert_array_equal(e, q80[ids])
    want = x @ (q80 if tied else q80 * scale[:, None]).T
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()


def test_an_embedding_whose_blocks_have_minima_stays_float32_and_says_why(reader):
    q41 = values_of(reader, "Q4_1.weight")
    model = _tied_graph(q41)
    report = carry_gguf_blocks(model, reader)
    (table,) = [r for r in report if r.embedding]
    assert "minima" in table.reason
    assert "Gather" in [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("rank_known", [True, False])
def test_block_minima_are_added_exactly_whether_or_not_the_inputs_rank_is_known(
        reader, monkeypatch, rank_known):
    """A block minimum's term ``S M``: ``S`` by a ReduceSum where the input's rank is known
    (no weights), by block-diagonal ones where it is not; both exact."""
    q41 = values_of(reader, "Q4_1.weight")
    model = _graph([q41])
    if not rank_known:
        model.graph.input[0].type.tensor_type.ClearField("shape")
    monkeypatch.setattr(gguf_blocks, "ACCURACY_LEVEL", 0)
    carry_gguf_blocks(model, reader)
    ops = [n.op_type for n in model.graph.node]
    assert ("ReduceSum" in ops) == rank_known and ops.count("MatMul") == (1 if rank_known else 2)
    x = np.random.default_rng(4).standard_normal((1, 3, COLS)).astype(np.float32)
    (got,) = _run(model, x)
    want = x @ q41.T
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_taking_the_minima_out_leaves_each_carried_nodes_own_product(reader, monkeypatch,
                                                                     benchmark_scripts):
    """benchmarks/int4_minima.py's bound: the graph without its block-minimum terms computes
    ``x (scale k)`` for a node with minima (Q4_1) and is unchanged for one without (Q8_0),
    and what it takes out is the term's nodes and minima."""
    monkeypatch.setattr(gguf_blocks, "ACCURACY_LEVEL", 0)
    with_min, without = values_of(reader, "Q4_1.weight"), values_of(reader, "Q8_0.weight")
    model = _graph([with_min, with_min[::-1], without])  # two nodes share the input's sums
    carry_gguf_blocks(model, reader)
    blocks, _ = decode_tensor(next(t for t in reader.tensors if t.name == "Q4_1.weight"))
    own = (blocks.scale[..., None] * blocks.k).reshape(ROWS, COLS)
    with benchmark_scripts("int4_minima") as int4_minima:
        bound, counts = int4_minima.without_minima(model)
    assert counts["nodes"] == {"Add": 2, "MatMul": 2, "ReduceSum": 1, "Reshape": 1}
    assert counts["minima_bytes"] == 2 * ROWS * (COLS // 32) * 4
    assert [n.op_type for n in bound.graph.node if n.op_type != "Cast"] == ["MatMulNBits"] * 3
    onnx.checker.check_model(bound)
    x = np.random.default_rng(5).standard_normal((1, 3, COLS)).astype(np.float32)
    for w, got in zip([own, own[::-1], without], _run(bound, x), strict=True):
        want = x @ w.T
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # and the minima were what the exported graph added: x W differs from x (scale k)
    assert np.abs(x @ with_min.T - x @ own.T).max() > 1e-3


def test_the_minima_are_not_taken_out_where_another_node_reads_the_product(reader, monkeypatch,
                                                                       benchmark_scripts):
    """A carried node's own product read by a node besides the minimum's Add would lose its
    producer: the bound refuses such a graph."""
    monkeypatch.setattr(gguf_blocks, "ACCURACY_LEVEL", 0)
    model = _graph([values_of(reader, "Q4_1.weight")])
    carry_gguf_blocks(model, reader)
    add = next(n for n in model.graph.node if n.name.endswith(gguf_blocks.MINIMUM_ADD))
    model.graph.node.append(helper.make_node("Identity", [add.input[0]], ["Z"]))
    model.graph.output.append(helper.make_tensor_value_info("Z", TensorProto.FLOAT, None))
    with benchmark_scripts("int4_minima") as int4_minima, \
            pytest.raises(ValueError, match="that only it reads"):
        int4_minima.without_minima(model)
