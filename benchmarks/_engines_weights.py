"""What one decode step of an engine streams from memory: the weight bytes of its matrix
products (ONNX) or of a GGUF's tensors (benchmarks/engines.py's bandwidth column)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

#: operators whose constant inputs are the weights a decode step streams through (an
#: embedding's Gather reads one row per token and is left out)
MATRIX_OPS = {"MatMul", "Gemm", "MatMulNBits", "FusedMatMul", "MatMulInteger",
              "MatMulIntegerToFloat", "DynamicQuantizeMatMul"}


def step_weight_bytes(folder: Path) -> int | None:
    """Bytes of weights one decode step of the engine in ``folder`` reads, as ONNX Runtime
    holds them: every constant input of a matrix product (MatMulNBits' codes, scales and
    zero points, the block minima's MatMul, fp32 weights), a float16 constant that a Cast
    feeds in counted at float32 (ONNX Runtime folds the Cast at load). None where the folder
    has no ``model.onnx``. A lower bound on the traffic: ONNX Runtime's packed layouts may
    add to it, the KV cache and activations are not counted."""
    import onnx
    from onnx import helper

    path = Path(folder) / "model.onnx"
    if not path.is_file():
        return None
    graph = onnx.load(str(path), load_external_data=False).graph
    inits = {i.name: i for i in graph.initializer}

    def size(name: str, itemsize: int | None = None) -> int:
        init = inits[name]
        count = int(np.prod(init.dims)) if init.dims else 1
        return count * (itemsize or helper.tensor_dtype_to_np_dtype(init.data_type).itemsize)

    cast = {n.output[0]: (n.input[0], helper.tensor_dtype_to_np_dtype(
        next(a.i for a in n.attribute if a.name == "to")).itemsize)
        for n in graph.node if n.op_type == "Cast" and n.input[0] in inits}
    seen, total = set(), 0
    for node in graph.node:
        if node.op_type not in MATRIX_OPS:
            continue
        for name in node.input:
            if name in seen:
                continue
            seen.add(name)
            if name in inits:
                total += size(name)
            elif name in cast:
                total += size(*cast[name])
    return total


def gguf_step_bytes(path: Path) -> int:
    """Bytes of weights one decode step of llama.cpp on the GGUF at ``path`` reads: every
    matrix's blocks as stored, the token embedding only where it is also the head (no
    ``output.weight``)."""
    import gguf

    tensors = gguf.GGUFReader(str(path)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors
               if len([d for d in t.shape if d > 1]) >= 2
               and (tied or t.name != "token_embd.weight"))
