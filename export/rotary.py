"""Rotary caches written as the few numbers they are made of.

onnxruntime-genai's builder stores each rotary cache as a float32 table ``cos(t f_i) m`` (and
its ``sin``) for every position ``t`` of the context: for Gemma-3-270M four tables of 32,768
x 128, 67 MB, a quarter of the model's own GGUF. The tables are a function of their inverse
frequencies ``f`` and scale ``m``; this module finds those from the table itself and writes
the graph that computes the table instead (``Range``, ``Mul``, ``Cos``/``Sin``), which ONNX
Runtime folds back into the same table when it loads the engine: the same memory at run time,
a few hundred bytes on disk.

A table is replaced only when that graph, run here, reproduces it to within
:data:`TOLERANCE` at every position (float32 cosines of one implementation against another);
any other table (positions scaled, frequencies not a plain product) stays as it is.
"""

from __future__ import annotations

import logging

import numpy as np

__all__ = ["TOLERANCE", "compact_rotary_caches"]

logger = logging.getLogger(__name__)

#: the largest difference allowed between a stored table and the computed one (float32
#: cosines and sines of different libraries differ by an ulp or two of values <= 1)
TOLERANCE = 1e-6


def _pairs(graph) -> list[tuple[str, str]]:
    names = {i.name for i in graph.initializer}
    return [(n, n.replace("cos_cache", "sin_cache", 1)) for n in sorted(names)
            if "cos_cache" in n and n.replace("cos_cache", "sin_cache", 1) in names]


def _frequencies(cos: np.ndarray, sin: np.ndarray):
    """``(f, m)`` with ``cos[t] = cos(t f) m`` and ``sin[t] = sin(t f) m``, or None when row 0
    is not ``(m, 0)``. Row 1's angle gives ``f`` roughly; the angles of rows 2, 4, 8, ...
    (unwrapped by the estimate so far) refine it; then, of the float32 values within a few
    ulps, each column keeps the one whose float32 products ``t f`` reproduce rows far out."""
    scale = float(cos[0, 0])
    length = cos.shape[0]
    if length < 2 or scale <= 0 or np.any(cos[0] != scale) or np.any(sin[0] != 0):
        return None
    c64, s64 = cos.astype(np.float64), sin.astype(np.float64)
    estimate = np.arctan2(s64[1], c64[1])
    t = 2
    while t < length:
        angle = np.arctan2(s64[t], c64[t])
        wraps = np.rint((t * estimate - angle) / (2 * np.pi))
        estimate = (angle + 2 * np.pi * wraps) / t
        t *= 2
    base = estimate.astype(np.float32)
    candidates = [base]
    for direction in (np.inf, -np.inf):
        step = base
        for _ in range(3):
            step = np.nextafter(step, np.float32(direction))
            candidates.append(step)
    candidates = np.stack(candidates)  # [7, D]
    rows = np.unique(np.array([1, length // 3, length // 2, length - 1]))
    angles = (rows[:, None, None].astype(np.float32) * candidates[None]).astype(np.float32)
    error = (np.abs(np.cos(angles.astype(np.float64)) * scale - c64[rows][:, None, :])
             + np.abs(np.sin(angles.astype(np.float64)) * scale - s64[rows][:, None, :]))
    best = error.max(axis=0).argmin(axis=0)
    return candidates[best, np.arange(candidates.shape[1])], np.float32(scale)


def _nodes(prefix: str, length: int, freq: np.ndarray, scale: np.float32, cos: str, sin: str):
    """The nodes and initializers that compute the two tables under the names ``cos`` and
    ``sin`` (positions as float32 integers times the frequencies, a float32 product as the
    builder's ``outer(t, f)``)."""
    from onnx import helper, numpy_helper

    consts = {f"{prefix}.start": np.array(0, np.float32),
              f"{prefix}.limit": np.array(length, np.float32),
              f"{prefix}.delta": np.array(1, np.float32),
              f"{prefix}.axes": np.array([1], np.int64),
              f"{prefix}.freq": freq[None, :].astype(np.float32)}
    steps, angles = f"{prefix}.positions", f"{prefix}.angles"
    nodes = [helper.make_node("Range", [f"{prefix}.start", f"{prefix}.limit",
                                        f"{prefix}.delta"], [steps + "_1d"],
                              name=f"{prefix}/Range"),
             helper.make_node("Unsqueeze", [steps + "_1d", f"{prefix}.axes"], [steps],
                              name=f"{prefix}/Unsqueeze"),
             helper.make_node("Mul", [steps, f"{prefix}.freq"], [angles], name=f"{prefix}/Mul")]
    for op, out in (("Cos", cos), ("Sin", sin)):
        if scale == 1:
            nodes.append(helper.make_node(op, [angles], [out], name=f"{prefix}/{op}"))
        else:
            consts[f"{prefix}.scale"] = np.array(scale, np.float32)
            nodes += [helper.make_node(op, [angles], [f"{out}.unscaled"], name=f"{prefix}/{op}"),
                      helper.make_node("Mul", [f"{out}.unscaled", f"{prefix}.scale"], [out],
                                       name=f"{prefix}/{op}Scale")]
    return nodes, [numpy_helper.from_array(v, k) for k, v in consts.items()]


def _computed(nodes, inits, outputs: list[str], opset: int):
    """The tables ``outputs`` as ONNX Runtime computes ``nodes`` on this machine."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph(nodes, "rotary", [], [helper.make_tensor_value_info(
        o, TensorProto.FLOAT, None) for o in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session.run(outputs, {})


def compact_rotary_caches(model) -> list[dict]:
    """Replace each ``cos_cache``/``sin_cache`` initializer pair of ``model`` (an ONNX
    ModelProto, weights loaded) by the nodes that compute it, where those reproduce it
    (module docstring); returns one record per pair (``name``, ``bytes`` saved, or
    ``reason`` it stayed)."""
    from onnx import numpy_helper

    graph = model.graph
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
                default=17)
    opset = max(opset, 13)
    records, new_nodes, dropped = [], [], set()
    inits = {i.name: i for i in graph.initializer}
    for cos_name, sin_name in _pairs(graph):
        cos, sin = (numpy_helper.to_array(inits[n]) for n in (cos_name, sin_name))
        found = None if cos.shape != sin.shape or cos.ndim != 2 else _frequencies(cos, sin)
        if found is None:
            records.append({"name": cos_name, "reason": "not a table of cos(t f) m"})
            continue
        prefix = f"rotary.{cos_name}"
        nodes, consts = _nodes(prefix, cos.shape[0], *found, cos_name, sin_name)
        got_cos, got_sin = _computed(nodes, consts, [cos_name, sin_name], opset)
        error = max(float(np.abs(got_cos - cos).max()), float(np.abs(got_sin - sin).max()))
        if got_cos.shape != cos.shape or error > TOLERANCE:
            records.append({"name": cos_name, "reason": f"the computed table differs by "
                            f"{error:.2g} (more than {TOLERANCE:g})"})
            continue
        new_nodes += nodes
        graph.initializer.extend(consts)
        dropped |= {cos_name, sin_name}
        records.append({"name": cos_name, "bytes": cos.nbytes + sin.nbytes,
                        "max_abs_diff": error})
    if dropped:
        kept = [i for i in graph.initializer if i.name not in dropped]
        del graph.initializer[:]
        graph.initializer.extend(kept)
        nodes = list(graph.node)
        del graph.node[:]
        graph.node.extend(new_nodes + nodes)
    for record in records:
        if "bytes" in record:
            logger.info("rotary cache %s: computed at load (%.1f MB saved, max |diff| %.2g)",
                        record["name"], record["bytes"] / 1e6, record["max_abs_diff"])
        else:
            logger.info("rotary cache %s: kept (%s)", record["name"], record["reason"])
    return records
