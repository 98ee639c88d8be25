"""int4 engines that *are* the GGUF model: its quantisation blocks carried into MatMulNBits.

A GGUF's quantised weights are blocks along the input dimension, each ``w = scale * k +
min`` with small integers ``k``; the packaged models are dequantised to float32 once
(calm_runtime/data/models.py), so calm's fp32 graph holds exactly these values. Quantising that
graph again (``quantize_int4``'s MatMulNBitsQuantizer) is a second rounding; this module
instead finds, for every MatMul of the graph, the GGUF rows its weight columns came from and
writes MatMulNBits with those very blocks:

=======  ===========================  =========================================  =========
GGUF     block (inputs)               as ``scale * k + min``                     MatMulNBits
=======  ===========================  =========================================  =========
Q4_0     32, fp16 d                   k = q - 8                                  4 bits
Q4_1     32, fp16 d, m                k = q - 8, min = m + 8d                    4 bits
Q4_K     32 of a 256 super-block      scale = d sc, k = q - 8,                   4 bits
                                      min = 8 d sc - dmin m
Q5_0/1   32                           k = q - 16 (min = m + 16d)                 8 bits
Q5_K     32 of 256                    scale = d sc, k = q - 16,                  8 bits
                                      min = 16 d sc - dmin m
Q6_K     16 of 256                    scale = d sc, k = q - 32                   8 bits
Q8_0     32                           k = q                                      8 bits
=======  ===========================  =========================================  =========

MatMulNBits' symmetric form (no zero-point input: ``2^(bits-1)``) computes ``scale * k``
with ONNX Runtime's fast int8-compute kernels; a float zero point would be exact too but
takes a dequantising path 50x slower on this CPU. A block minimum is therefore added as
llama.cpp's own Q4_1 dot product does: ``x . (scale k + min) = scale (x . k) + min * sum(x)``
over the block, i.e. ``Y = MatMulNBits(X) + S M``, where ``S`` sums each block of inputs (a
ReduceSum over ``X`` seen as [..., K/block, block] where X's rank is known, else ``X E`` with
``E`` block-diagonal ones; shared by the MatMuls that read the same input) and ``M`` (K/block
x N) holds the minima: one small fp32 MatMul per carried node.

A weight column is matched to its GGUF row by its exact float32 values (a fingerprint, then
equality), so permuted rows (Llama's q/k), packed projections (the builder's q/k/v) and a
head scaled per row (``W / (tau T)``: the scale goes into the block scales) all carry over.
A MatMul whose weights are not the GGUF's (a merged LoRA, a centred head) is left to the
requantising path and listed. Every carried node is checked: its blocks dequantised must
equal the graph's weight within float32 rounding, else it is requantised too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

__all__ = ["Blocks", "CarriedNode", "carry_gguf_blocks", "decode_tensor", "SUPPORTED",
           "MINIMUM_ADD"]

logger = logging.getLogger(__name__)

#: the name's suffix of the Add that puts a carried node's block-minimum term ``S M`` on its
#: MatMulNBits' output (inputs: that output, the term); benchmarks/int4_minima.py finds them so
#: by it
MINIMUM_ADD = "/gguf_add_minima"

#: GGUF type -> (weights per block, MatMulNBits bits, the offset that centres an unsigned
#: q where the type has a block minimum; types without one store signed values already)
SUPPORTED = {"Q4_0": (32, 4, 0), "Q4_1": (32, 4, 8), "Q4_K": (32, 4, 8),
             "Q5_0": (32, 8, 0), "Q5_1": (32, 8, 16), "Q5_K": (32, 8, 16),
             "Q6_K": (16, 8, 0), "Q8_0": (32, 8, 0)}
#: a carried weight may differ from the graph's by this much relative to its row's largest
#: value (float32 rounding of ``scale * k + min`` and of a per-row head scale)
EXACT_RTOL = 2e-6
#: MatMulNBits' accuracy level 4: int8 compute (export/quantize.py)
ACCURACY_LEVEL = 4


@dataclass
class Blocks:
    """A matrix as blocks along its input dimension: ``w[r, b*block + j] = scale[r, b] *
    k[r, b, j] + minimum[r, b]`` (``minimum`` None: zero)."""

    k: np.ndarray  # int16 [rows, n_blocks, block]
    scale: np.ndarray  # float32 [rows, n_blocks]
    minimum: np.ndarray | None
    bits: int

    @property
    def block(self) -> int:
        return self.k.shape[2]

    def dequantize(self) -> np.ndarray:
        w = self.scale[..., None] * self.k.astype(np.float32)
        if self.minimum is not None:
            w = w + self.minimum[..., None]
        return w.reshape(w.shape[0], -1)

    def rows(self, index: np.ndarray, factor: np.ndarray | None = None) -> Blocks:
        scale = self.scale[index]
        minimum = None if self.minimum is None else self.minimum[index]
        if factor is not None:
            scale = scale * factor[:, None]
            minimum = None if minimum is None else minimum * factor[:, None]
        return Blocks(self.k[index], scale.astype(np.float32),
                      None if minimum is None else minimum.astype(np.float32), self.bits)

    def as_format(self, bits: int, block: int) -> Blocks:
        """The same values with ``bits`` (>= own) and a smaller or equal block size."""
        k, scale, minimum = self.k, self.scale, self.minimum
        if block < self.block:
            split = self.block // block
            rows, n = scale.shape
            k = k.reshape(rows, n * split, block)
            scale = np.repeat(scale, split, axis=1)
            minimum = None if minimum is None else np.repeat(minimum, split, axis=1)
        return Blocks(k, scale, minimum, bits)


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    return raw[:, at:at + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _block_scales(name: str, raw: np.ndarray):
    """Per-block ``scale`` and ``min`` (``min`` before the offset; None where the type has
    none) from the raw GGUF blocks ``raw`` [n_blocks, bytes] (the GGUF specification's
    layouts; k-quants' 6-bit sub-block scales unpacked by the gguf package)."""
    if name in ("Q4_0", "Q5_0", "Q8_0"):
        return _f16(raw, 0)[:, None], None
    if name in ("Q4_1", "Q5_1"):
        return _f16(raw, 0)[:, None], _f16(raw, 2)[:, None]
    if name in ("Q4_K", "Q5_K"):
        from gguf.quants import Q4_K

        d, dmin = _f16(raw, 0), _f16(raw, 2)
        sc, m = Q4_K.get_scale_min(raw[:, 4:16].copy())
        return d[:, None] * sc.astype(np.float32), -(dmin[:, None] * m.astype(np.float32))
    if name == "Q6_K":
        d = _f16(raw, 208)
        return d[:, None] * raw[:, 192:208].copy().view(np.int8).astype(np.float32), None
    raise ValueError(f"GGUF type {name} cannot be carried")


def decode_tensor(tensor) -> tuple[Blocks, np.ndarray]:
    """A GGUF tensor (``gguf.ReaderTensor`` of a :data:`SUPPORTED` type) as :class:`Blocks`
    and its dequantised float32 rows (the gguf package's, as the packaged models were made).

    ``k`` is recovered from the dequantised values and the block scales, then the blocks are
    checked to reproduce those values."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    name = tensor.tensor_type.name
    block, bits, offset = SUPPORTED[name]
    rows_n, cols = int(tensor.shape[1]), int(tensor.shape[0])  # ne0 = inputs
    raw = np.asarray(tensor.data)
    values = dequantize(raw, tensor.tensor_type).reshape(rows_n, cols).astype(np.float32)
    type_size = GGML_QUANT_SIZES[tensor.tensor_type][1]
    native = raw.reshape(-1).view(np.uint8).reshape(-1, type_size)
    scale, minimum = _block_scales(name, native)
    scale = scale.reshape(rows_n, cols // block)
    minimum = None if minimum is None else minimum.reshape(rows_n, cols // block)
    grid = values.reshape(rows_n, cols // block, block)
    base = 0.0 if minimum is None else minimum[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[..., None] != 0, np.rint((grid - base) / scale[..., None]), 0)
    k = (q - offset).astype(np.int16)
    if minimum is not None:  # w = scale q + min = scale (q - offset) + (min + offset scale)
        minimum = (minimum + offset * scale).astype(np.float32)
    blocks = Blocks(k, scale.astype(np.float32), minimum, bits)
    limit = 1 << (bits - 1)
    if k.min(initial=0) < -limit or k.max(initial=0) >= limit or not _close(
            blocks.dequantize(), values):
        raise ValueError(f"{tensor.name}: the {name} blocks do not reproduce the GGUF's values")
    return blocks, values


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    scale = np.abs(b).max(axis=-1, keepdims=True)
    return bool(np.all(np.abs(a - b) <= EXACT_RTOL * scale + 1e-30))


# ---------------------------------------------------------------------------- the graph
@dataclass
class CarriedNode:
    """What became of one MatMul: its source rows' GGUF types, or why it stays for requantising."""

    node: str
    types: tuple[str, ...] = ()
    scaled: bool = False
    reason: str | None = None
    #: the fp32 MatMuls added for a block minimum (left unquantised)
    extra_nodes: tuple[str, ...] = ()
    #: a Gather of an embedding table (GatherBlockQuantized once carried), not a MatMul
    embedding: bool = False
    #: an embedding that reads a carried head's integers (no copy of its own)
    shared: bool = False


def _fingerprints(values: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """One uint64 per row from its exact float32 bits (wrap-around arithmetic; equal rows,
    equal fingerprints, wherever they sit)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    weights = np.random.default_rng(0).integers(1, 2**63, bits.shape[1], dtype=np.uint64) | 1
    out = np.empty(bits.shape[0], np.uint64)
    with np.errstate(over="ignore"):
        for start in range(0, bits.shape[0], chunk):
            part = bits[start:start + chunk].astype(np.uint64)
            out[start:start + chunk] = (part * weights).sum(axis=1)
    return out


class _Source:
    """The GGUF's carriable matrices, decoded once, with a row index by exact value."""

    def __init__(self, reader):
        self.blocks: dict[str, Blocks] = {}
        self.values: dict[str, np.ndarray] = {}
        self.types: dict[str, str] = {}
        self.index: dict[tuple[int, int], tuple[str, int]] = {}
        for tensor in reader.tensors:
            name = tensor.tensor_type.name
            if name not in SUPPORTED or len(tensor.shape) != 2:
                continue
            blocks, values = decode_tensor(tensor)
            self.blocks[tensor.name], self.values[tensor.name] = blocks, values
            self.types[tensor.name] = name
            cols = values.shape[1]
            for row, fp in enumerate(_fingerprints(values).tolist()):
                self.index.setdefault((cols, fp), (tensor.name, row))

    def exact_rows(self, weight: np.ndarray):
        """``[(tensor, row)]`` for every row of ``weight`` [N, K], or None."""
        cols = weight.shape[1]
        found = [self.index.get((cols, fp)) for fp in _fingerprints(weight).tolist()]
        if any(f is None for f in found):
            return None
        return found

    def scaled_rows(self, weight: np.ndarray):
        """``(tensor, factor)`` when ``weight`` is a whole GGUF matrix with each row scaled
        (a calibrated head ``W / (tau T)``), else None."""
        for name, values in self.values.items():
            if values.shape != weight.shape:
                continue
            v64 = values.astype(np.float64)
            norm = np.einsum("ij,ij->i", v64, v64)
            factor = np.where(norm > 0, np.einsum("ij,ij->i", weight.astype(np.float64), v64)
                              / np.where(norm > 0, norm, 1), 0.0)
            if _close((v64 * factor[:, None]).astype(np.float32), weight):
                return name, factor.astype(np.float32)
        return None


def _node_blocks(source: _Source, rows) -> Blocks:
    """The blocks of a node whose output ``n`` is GGUF row ``rows[n]``; rows from several
    tensors share the widest bits and the smallest block."""
    names = sorted({name for name, _ in rows})
    bits = max(source.blocks[n].bits for n in names)
    block = min(source.blocks[n].block for n in names)
    parts = {n: source.blocks[n].as_format(bits, block) for n in names}
    first = parts[names[0]]
    count = len(rows)
    k = np.empty((count, *first.k.shape[1:]), np.int16)
    scale = np.empty((count, first.scale.shape[1]), np.float32)
    has_min = any(p.minimum is not None for p in parts.values())
    minimum = np.zeros_like(scale) if has_min else None
    for name in names:
        out = np.array([i for i, (t, _) in enumerate(rows) if t == name])
        src = np.array([r for t, r in rows if t == name])
        part = parts[name]
        k[out], scale[out] = part.k[src], part.scale[src]
        if has_min and part.minimum is not None:
            minimum[out] = part.minimum[src]
    return Blocks(k, scale, minimum, bits)


def _pack(blocks: Blocks) -> np.ndarray:
    """MatMulNBits' B: [N, n_blocks, block * bits / 8] uint8, symmetric (zero point
    2^(bits-1)); 4 bits: element 2i in the low nibble, 2i + 1 in the high one."""
    stored = (blocks.k + (1 << (blocks.bits - 1))).astype(np.uint8)
    if blocks.bits == 8:
        return stored
    return (stored[..., 0::2] | (stored[..., 1::2] << 4)).astype(np.uint8)


def _embedding_weight(node, inits, producers):
    """``(initializer name, [V, H] float32 table, the Transpose between them or None)`` when
    the Gather ``node`` reads rows of a constant table (an embedding, or a tied head's
    ``W^T`` read through a Transpose), else None."""
    from onnx import TensorProto, numpy_helper

    if node.op_type != "Gather" or next((a.i for a in node.attribute if a.name == "axis"), 0):
        return None
    data, transpose = node.input[0], None
    if data not in inits and data in producers and producers[data].op_type == "Transpose":
        transpose = producers[data]
        perm = [list(a.ints) for a in transpose.attribute if a.name == "perm"]
        if perm not in ([], [[1, 0]]):
            return None
        data = transpose.input[0]
    init = inits.get(data)
    if init is None or init.data_type != TensorProto.FLOAT or len(init.dims) != 2:
        return None
    table = numpy_helper.to_array(init)
    return data, (table.T if transpose is not None else table), transpose


def _carry_embeddings(graph, source: _Source, packed) -> list[CarriedNode]:
    """Every Gather of a constant table whose rows are a GGUF matrix's (the token embedding)
    becomes ``GatherBlockQuantized`` on those very blocks: the bytes of a head carried from
    the same rows are shared (a tied model stores its vocabulary once), and the float32 table
    goes where nothing else reads it. A table whose blocks have minima (no integer zero
    point holds them) stays float32, listed."""
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    report, nodes, added = [], [], []
    for node in graph.node:
        found = _embedding_weight(node, inits, producers)
        if found is None:
            nodes.append(node)
            continue
        name, table, transpose = found
        rows = source.exact_rows(table)
        blocks = None if rows is None else _node_blocks(source, rows)
        reason = ("its rows are not the GGUF's" if blocks is None else
                  "its blocks have minima" if blocks.minimum is not None else
                  "its carried blocks differ from the table" if not _close(
                      blocks.dequantize(), table) else None)
        if reason is not None:
            report.append(CarriedNode(node.name, reason=reason, embedding=True))
            nodes.append(node)
            continue
        q = _pack(blocks)
        shared = next((p for p in packed if p[1] == q.shape
                       and np.array_equal(numpy_helper.to_array(inits[p[0]]), q)), None)
        tag = node.name.strip("/").replace("/", "_") or name
        q_name = shared[0] if shared else f"{tag}.gguf_q"
        s_name = f"{tag}.gguf_scales3d"
        if shared is None:
            added.append(numpy_helper.from_array(q, q_name))
        if shared is not None and np.array_equal(shared[3], blocks.scale):
            shape = f"{tag}.gguf_scales_shape"
            added.append(numpy_helper.from_array(np.array([*blocks.scale.shape, 1], np.int64),
                                                 shape))
            nodes.append(helper.make_node("Reshape", [shared[2], shape], [s_name],
                                          name=f"{tag}/gguf_scales"))
        else:
            added.append(numpy_helper.from_array(blocks.scale[..., None].copy(), s_name))
        gathered, index_shape, out_shape = (f"{tag}.gguf_blocks", f"{tag}.gguf_index_shape",
                                            f"{tag}.gguf_out_shape")
        width = f"{tag}.gguf_width"
        added.append(numpy_helper.from_array(np.array([table.shape[1]], np.int64), width))
        nodes += [
            helper.make_node("GatherBlockQuantized", [q_name, node.input[1], s_name],
                             [gathered], name=node.name, domain="com.microsoft",
                             bits=blocks.bits, block_size=blocks.block, gather_axis=0,
                             quantize_axis=2),
            helper.make_node("Shape", [node.input[1]], [index_shape], name=f"{tag}/gguf_shape"),
            helper.make_node("Concat", [index_shape, width], [out_shape], axis=0,
                             name=f"{tag}/gguf_out_shape"),
            helper.make_node("Reshape", [gathered, out_shape], [node.output[0]],
                             name=f"{tag}/gguf_rows")]
        report.append(CarriedNode(node.name, types=tuple(sorted({source.types[t]
                                                                 for t, _ in rows})),
                                  embedding=True, shared=shared is not None))
        if transpose is not None and not any(transpose.output[0] in n.input
                                             for n in graph.node if n is not node):
            nodes = [n for n in nodes if n is not transpose]
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(added)
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    kept = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return report


def _block_sums(x: str, rank: int | None, k_in: int, block: int, tag: str):
    """``S``, the sum of each block of ``block`` inputs of ``x`` [..., k_in]: ``(name, nodes,
    initializers, MatMuls to keep unquantised)``. Where ``x``'s rank is known, a ReduceSum
    over ``x`` seen as [..., k_in/block, block] (no weights); else ``x E`` with ``E`` the
    [k_in, k_in/block] block-diagonal ones."""
    from onnx import helper, numpy_helper

    sums = f"{tag}.gguf_block_sums"
    if rank is None:
        ones = np.kron(np.eye(k_in // block, dtype=np.float32), np.ones((block, 1), np.float32))
        return sums, [helper.make_node("MatMul", [x, f"{tag}.gguf_block_ones"], [sums],
                                       name=f"{tag}/gguf_block_sums")], \
            [numpy_helper.from_array(ones, f"{tag}.gguf_block_ones")], [f"{tag}/gguf_block_sums"]
    grid, shape, axes = f"{tag}.gguf_block_grid", f"{tag}.gguf_grid_shape", f"{tag}.gguf_sum_axes"
    inits = [numpy_helper.from_array(np.array([0] * (rank - 1) + [k_in // block, block],
                                              np.int64), shape),
             numpy_helper.from_array(np.array([-1], np.int64), axes)]
    nodes = [helper.make_node("Reshape", [x, shape], [grid], name=f"{tag}/gguf_block_grid"),
             helper.make_node("ReduceSum", [grid, axes], [sums], keepdims=0,
                              name=f"{tag}/gguf_block_sums")]
    return sums, nodes, inits, []


def carry_gguf_blocks(model, reader) -> list[CarriedNode]:
    """Replace every MatMul of ``model`` (an ONNX ModelProto, weights loaded) whose constant
    weight is the GGUF ``reader``'s rows with MatMulNBits on those blocks (module
    docstring); returns one :class:`CarriedNode` per constant-weight MatMul."""
    from onnx import TensorProto, helper, numpy_helper

    source = _Source(reader)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    users: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            users[name] = users.get(name, 0) + 1
    block_sums: dict[tuple[str, int], str] = {}
    ranks = {v.name: len(v.type.tensor_type.shape.dim)
             for v in [*graph.value_info, *graph.input, *graph.output]
             if v.type.tensor_type.HasField("shape")}
    report, new_nodes, new_inits, dropped = [], [], [], set()
    packed: list[tuple[str, tuple, str, np.ndarray]] = []  # (B, its shape, scales, their values)
    prologue = []  # nodes of constants only, first in the graph
    for node in list(graph.node):
        weight_name = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
        init = inits.get(weight_name) if weight_name else None
        if init is None or init.data_type != TensorProto.FLOAT or len(init.dims) != 2:
            new_nodes.append(node)
            continue
        weight = numpy_helper.to_array(init).T  # [N, K]
        rows, factor = source.exact_rows(weight), None
        if rows is None:
            scaled = source.scaled_rows(weight)
            if scaled is not None:
                name, factor = scaled
                rows = [(name, r) for r in range(weight.shape[0])]
        if rows is None:
            report.append(CarriedNode(node.name, reason="its weights are not the GGUF's "
                                      "(a merged LoRA or a centred head)"))
            new_nodes.append(node)
            continue
        blocks = _node_blocks(source, rows)
        if factor is not None:
            blocks = blocks.rows(np.arange(len(rows)), factor)
        if not _close(blocks.dequantize(), weight):
            report.append(CarriedNode(node.name, reason="its carried blocks differ from the "
                                      "graph's weights"))
            new_nodes.append(node)
            continue
        n, k_in = weight.shape
        tag = node.name.strip("/").replace("/", "_") or weight_name
        b_name, s_name = f"{tag}.gguf_q", f"{tag}.gguf_scales"
        q = _pack(blocks)
        new_inits.append(numpy_helper.from_array(q, b_name))
        scales = blocks.scale.reshape(-1)
        if np.array_equal(scales.astype(np.float16).astype(np.float32), scales):
            # float16 on disk where that is lossless (the GGUF's own fp16 scales, Q8_0's,
            # Q4_0's); ONNX Runtime folds the Cast into a float32 initializer at load
            new_inits.append(numpy_helper.from_array(scales.astype(np.float16), s_name + "16"))
            prologue.append(helper.make_node("Cast", [s_name + "16"], [s_name],
                                             to=TensorProto.FLOAT, name=f"{tag}/gguf_scales"))
        else:
            new_inits.append(numpy_helper.from_array(scales, s_name))
        packed.append((b_name, q.shape, s_name, blocks.scale))
        out = node.output[0]
        main_out = out if blocks.minimum is None else f"{tag}.gguf_scaled"
        new_nodes.append(helper.make_node(
            "MatMulNBits", [node.input[0], b_name, s_name], [main_out], name=node.name,
            domain="com.microsoft", K=k_in, N=n, bits=blocks.bits, block_size=blocks.block,
            accuracy_level=ACCURACY_LEVEL))
        extra = []
        if blocks.minimum is not None:  # + S M: each block's input sum times its minimum
            key = (node.input[0], blocks.block)
            if key not in block_sums:
                sums, nodes, inits_, kept = _block_sums(node.input[0], ranks.get(node.input[0]),
                                                        k_in, blocks.block, tag)
                new_nodes += nodes
                new_inits += inits_
                extra += kept
                block_sums[key] = sums
            m_name, m_out = f"{tag}.gguf_minima", f"{tag}.gguf_minimum_term"
            new_inits.append(numpy_helper.from_array(blocks.minimum.T.copy(), m_name))
            new_nodes += [helper.make_node("MatMul", [block_sums[key], m_name], [m_out],
                                           name=f"{tag}/gguf_minima"),
                          helper.make_node("Add", [main_out, m_out], [out],
                                           name=tag + MINIMUM_ADD)]
            extra.append(f"{tag}/gguf_minima")
        users[weight_name] -= 1
        if users[weight_name] == 0:
            dropped.add(weight_name)
        types = tuple(sorted({source.types[t] for t, _ in rows}))
        report.append(CarriedNode(node.name, types=types, scaled=factor is not None,
                                  extra_nodes=tuple(extra)))
    kept = [i for i in graph.initializer if i.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)
    del graph.node[:]
    graph.node.extend(prologue + new_nodes)
    report += _carry_embeddings(graph, source, packed)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return report
