"""Reduced-precision variants of the validated fp32 graph (int8 weights, fp16) and their drift.

The fp32 ``model.onnx`` is exported and validated against the reference first; a variant
is then built from it in the same staging folder and measured against it: at every
position of the validation prompts and of :data:`DRIFT_PROMPTS` (prompt positions and
greedy steps, the variant replaying the fp32 engine's tokens) the report gives the
largest and mean change of a next-token probability, the total variation between the two
next-token distributions, and how often the top token is the same.

int8 schemes: ``quantize_dynamic`` quantises each activation tensor with one scale per
tensor; SmolLM2's activations have outlier channels (down_proj's input worst), and in the
trials that chose the default no choice of layers kept fp32 brought it near the fp32 engine
(no result file records those trials). The ``blockwise`` scheme (MatMulNBits, 8 bits,
symmetric, one scale per ``block_size`` weights, ``accuracy_level`` 4: activations
quantised per block too) quantises every MatMul and is the default. Its drift and speed are
measured by ``python benchmarks/int4_blocks.py --engine ENGINE`` (the ``int8 block 32`` row
of benchmarks/results/int4_blocks.md) and ``python benchmarks/engines.py --model
smollm2-135m-instruct --rounds 3 --long-rounds 2`` (the ``calm int8`` rows of
benchmarks/results/engines.md: ARC-Easy accuracy 0.476 and ECE 0.148 against fp32's 0.474
and 0.149; top-1 agreement 0.988 on the short drift prompts of then, 0.969 on the 988
positions of the passages now in :data:`DRIFT_PROMPTS`).

int4 (``--quantize int4``): the same MatMulNBits scheme with 4 bits, every MatMul, blocks of 32
(``ExportConfig.int4_block_size``; the block sizes compared in
benchmarks/results/int4_blocks.md, by the command above). A model that came from a GGUF is
already quantised: its MatMuls keep the GGUF's own blocks (export/gguf_blocks.py) and only
weights that are not the GGUF's are quantised anew (``--int4-blocks requantize`` quantises
everything anew). On SmolLM2 (``calm-export --model smollm2-135m-instruct --quantize int4``)
the carried engine keeps the fp32 top token at 0.975 of 988 drift positions (95% interval
0.963-0.983), where quantising anew kept 0.715 (gemma-3-270m's Q4_K_M: 0.973 of 1,016);
benchmarks/results/engines.md has the engines' speed and drift, and their accuracy and ECE
(``python benchmarks/engines.py``).

fp16 (``--dtype fp16`` with ONNX, meant for GPU providers): onnxruntime's converter turns
weights, activations and the KV cache into float16 and keeps the logits output float32.
The fp16 graph itself is validated against the reference with the fp16 tolerance on the
CPU EP, which runs ops that lack fp16 CPU kernels in fp32 between inserted casts; GPU
kernels round differently, and no GPU provider is part of this validation. Keeping
RMSNorm's Pow/ReduceMean in fp32 through the converter's block list broke the SmolLM2
graph (logits off by their own size), while the default conversion stayed within the fp16
tolerance of the fp32 logits (which every fp16 export's validation checks), so the default
block list is used.
"""

from __future__ import annotations

import ast
import contextlib
import fnmatch
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .graphs.calm_graph import ONNX_FILE, save_onnx

__all__ = [
    "DRIFT_PROMPTS",
    "module_path",
    "linear_nodes",
    "quantize_int8",
    "quantize_int4",
    "convert_fp16",
    "measure_drift",
    "stash_fp32",
]

logger = logging.getLogger(__name__)

#: Plain text, code and a list, beside the validation prompts, so the drift covers text
#: the model continues fluently as well as the scoring formats. The four passages give the
#: measure its positions (about a thousand on SmolLM2 with the validation prompts and the
#: greedy steps; at 400 positions, engines with the very same weights read 97.8% to 99.3%
#: top-1 agreement); the last two prompts also run as a padded batch of two.
DRIFT_PROMPTS = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "The lighthouse keeper kept a notebook of the weather. Every morning at six he wrote "
    "down the direction of the wind, the height of the waves and the colour of the sky, and "
    "every evening he read the entries for the same day in earlier years. Over forty winters "
    "the notebook had grown into a shelf of notebooks, and the shelf had become a kind of "
    "memory that the village trusted more than the radio. When the fishermen asked whether "
    "the boats should go out, he would open three or four of the old books, compare the "
    "pages, and give an answer that was right more often than it was wrong. He never said "
    "he was certain; he said only how often a morning like this one had",
    "A hash table stores pairs of keys and values in an array of buckets. To insert a pair, "
    "the table computes a hash of the key, reduces it modulo the number of buckets, and "
    "places the pair in the bucket at that index. Two keys can land in the same bucket; "
    "this is called a collision, and it is usually handled either by keeping a short list "
    "in each bucket or by probing the following buckets until an empty one is found. As "
    "the table fills, collisions become more frequent and lookups slow down, so most "
    "implementations grow the array and move every pair to its new bucket when",
    "Q: Why does ice float on water?\nA: Because water expands when it freezes. The "
    "molecules in ice are held in an open lattice by hydrogen bonds, so ice is about nine "
    "percent less dense than liquid water.\nQ: What would happen if ice sank?\nA: Lakes "
    "would freeze from the bottom up. Each winter's ice would collect on the lake bed, "
    "where the summer's warmth reaches it slowly.\nQ: Do other substances expand when they "
    "freeze?\nA:",
    "import json\n\n\ndef load_records(path):\n    \"\"\"Read one JSON object per line, "
    "skipping blank lines.\"\"\"\n    records = []\n    with open(path, encoding=\"utf-8\") "
    "as handle:\n        for number, line in enumerate(handle, start=1):\n            line "
    "= line.strip()\n            if not line:\n                continue\n            try:\n"
    "                records.append(json.loads(line))\n            except "
    "json.JSONDecodeError as error:\n                raise ValueError(f\"{path}:{number}: "
    "{error}\") from None\n    return records\n\n\ndef count_by_label(records):\n    "
    "counts = {}\n    for record in records:\n",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "Photosynthesis is the process by which plants",
)
#: MatMulNBits' accuracy level 4: int8 compute, activations quantised per block (level 0
#: dequantises the weights and runs fp32: 24x slower here, see the table above).
BLOCKWISE_ACCURACY_LEVEL = 4
#: Graph outputs the fp16 conversion keeps float32 (the engine contract: float32 logits).
FP16_KEEP_IO = ("logits",)


def module_path(node) -> str:
    """The torch module a graph node was exported from ("model.layers.0.mlp.down_proj",
    "lm_head"), or "" when the graph does not say (the wrapper's ``model.`` is dropped)."""
    for prop in node.metadata_props:  # the dynamo exporter records the module scopes
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return ""
            paths = [s for s in scopes if isinstance(s, str) and s.startswith("model")]
            return _strip(paths[-1]) if paths else ""
    if node.name.startswith("/"):  # TorchScript: "/model/model/layers.0/mlp/down_proj/MatMul"
        # (onnxruntime-genai's builder: "/model/layers.0/mlp/down_proj/MatMul", "/lm_head/MatMul")
        path = ".".join(node.name.strip("/").split("/")[:-1])
        torchscript = path.startswith("model.model.") or path == "model.lm_head"
        return _strip(path) if torchscript else path
    return ""


def _strip(path: str) -> str:
    return path[len("model."):] if path.startswith("model.") else ""


def _matches(path: str, patterns: Sequence[str]) -> bool:
    return bool(path) and any(path == p or path.endswith("." + p) or fnmatch.fnmatchcase(path, p)
                              for p in patterns)


def linear_nodes(model) -> list[tuple[str, str]]:
    """``(node name, module path)`` of every MatMul with a constant float weight (the
    nodes both int8 schemes can quantise; attention's MatMuls have no constant input)."""
    from onnx import TensorProto

    floats = {i.name for i in model.graph.initializer if i.data_type == TensorProto.FLOAT}
    return [(n.name, module_path(n)) for n in model.graph.node
            if n.op_type == "MatMul" and len(n.input) == 2 and n.input[1] in floats]


def stash_fp32(staging: Path) -> Path:
    """Move the fp32 graph into ``staging/.fp32/`` (the variant takes its place)."""
    work = staging / ".fp32"
    work.mkdir()
    for path in staging.glob(f"{ONNX_FILE}*"):
        shutil.move(str(path), str(work / path.name))
    return work


@contextlib.contextmanager
def _quiet_root():
    """onnxruntime.quantization logs advice through the root logger; keep it out of the CLI."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def quantize_int4(source: Path, target: Path, config, *, external: bool,
                  gguf_spec=None) -> dict:
    """Quantise every MatMul of the fp32 graph ``source`` to 4 bits (MatMulNBits, blocks of
    ``config.int4_block_size``, symmetric, int8 compute) into ``target``; the facts for the
    manifest as :func:`quantize_int8` gives them.

    With ``gguf_spec`` (the model came from that GGUF: a path or a packaged name) and
    ``config.int4_blocks == "auto"``, the MatMuls whose weights are the GGUF's carry its own
    blocks (export/gguf_blocks.py) and only the others are quantised anew."""
    if gguf_spec is None or config.int4_blocks != "auto":
        return quantize_int8(source, target, config, external=external, bits=4)
    import onnx

    from calm_runtime.formats.gguf_layout import check_gguf_layout

    from .gguf_blocks import carry_gguf_blocks
    from .gguf_file import require_gguf, source_gguf
    from .rotary import compact_rotary_caches

    gguf = require_gguf()
    model = onnx.load(str(source), load_external_data=True)
    with source_gguf(gguf_spec, source.parent) as path:
        check_gguf_layout(path)  # before gguf's reader believes its counts
        report = carry_gguf_blocks(model, gguf.GGUFReader(path))
        gguf_name, gguf_bytes = path.name, path.stat().st_size
    rotary = compact_rotary_caches(model)  # the graph's own tables: the GGUF is not needed
    tables = [r for r in report if r.embedding]
    report = [r for r in report if not r.embedding]
    carried = [r for r in report if r.reason is None]
    left = [r for r in report if r.reason is not None]
    logger.info("int4 from %s's own blocks: %d of %d MatMuls carried, %d quantised anew",
                gguf_name, len(carried), len(report), len(left))
    staged = source.parent / "carried" / ONNX_FILE
    staged.parent.mkdir()
    save_onnx(model, staged, external)
    del model
    facts = quantize_int8(staged, target, config, external=external, bits=4,
                          keep=[n for r in carried for n in r.extra_nodes])
    types: dict[str, int] = {}
    for r in carried:
        key = "+".join(r.types)
        types[key] = types.get(key, 0) + 1
    facts["blocks"] = {
        "path": "gguf-blocks", "gguf_file": gguf_name, "carried_nodes": len(carried),
        "carried_types": types, "row_scaled_nodes": sum(r.scaled for r in carried),
        "requantised_nodes": [{"node": r.node, "reason": r.reason} for r in left],
        "gguf_bytes": gguf_bytes, "rotary_caches": rotary,
        "embeddings": [{"node": r.node, "types": list(r.types), "shares_head": r.shared}
                       if r.reason is None else {"node": r.node, "reason": r.reason}
                       for r in tables]}
    facts["quantized_nodes"] += len(carried)
    facts["linear_nodes"] += len(carried)
    facts["fp32_bytes"] = _size(source.parent)
    shutil.rmtree(staged.parent)
    return facts


def quantize_int8(source: Path, target: Path, config, *, external: bool, bits: int = 8,
                  keep: Sequence[str] = ()) -> dict:
    """Quantise the fp32 graph ``source`` into ``target`` (``model.onnx``); returns the facts
    for the manifest: scheme, settings, quantised and excluded nodes, sizes. ``bits=4``: the
    int4 engine (blockwise only, every MatMul). ``keep``: nodes left as they are and not
    counted (the block-minimum MatMuls of carried GGUF blocks)."""
    import onnx

    model = onnx.load(str(source), load_external_data=True)
    patterns = config.int8_excluded_modules() if bits == 8 else ()
    nodes = [(name, path) for name, path in linear_nodes(model) if name not in set(keep)]
    excluded = [(name, path) for name, path in nodes if _matches(path, patterns)]
    unmatched = [p for p in patterns if not any(_matches(path, [p]) for _, path in nodes)]
    if unmatched:
        logger.warning("int8_exclude pattern(s) %s match no quantisable module", unmatched)
    skip = [name for name, _ in excluded] + list(keep)
    with _quiet_root():
        if bits == 4 or config.int8_scheme == "blockwise":
            from onnxruntime.quantization.matmul_nbits_quantizer import (
                DefaultWeightOnlyQuantConfig,
                MatMulNBitsQuantizer,
            )

            block = config.int4_block_size if bits == 4 else config.int8_block_size
            settings = {"bits": bits, "block_size": block, "symmetric": True,
                        "accuracy_level": BLOCKWISE_ACCURACY_LEVEL, "op": "MatMulNBits"}
            algo = DefaultWeightOnlyQuantConfig(
                block_size=block, is_symmetric=True, bits=bits,
                accuracy_level=BLOCKWISE_ACCURACY_LEVEL, op_types_to_quantize=("MatMul",))
            quantizer = MatMulNBitsQuantizer(model, nodes_to_exclude=skip, algo_config=algo)
            quantizer.process()
            result = quantizer.model.model
        else:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            settings = {"weights": "int8 per channel", "activations": "uint8 per tensor",
                        "op": "MatMulInteger"}
            scratch = source.parent / "dynamic.onnx"
            quantize_dynamic(model, scratch, op_types_to_quantize=["MatMul"], per_channel=True,
                             reduce_range=False, weight_type=QuantType.QInt8,
                             nodes_to_exclude=skip, extra_options={"MatMulConstBOnly": True},
                             use_external_data_format=external)
            result = onnx.load(str(scratch), load_external_data=True)
    left = {n.name for n in result.graph.node if n.op_type == "MatMul"}
    quantized = [name for name, _ in nodes if name not in left]
    save_onnx(result, target, external)
    return {"scheme": "blockwise" if bits == 4 else config.int8_scheme, **settings,
            **({"blocks": {"path": "requantised"}} if bits == 4 else {}),
            "exclude": list(patterns),
            "excluded_nodes": [{"node": n, "module": p} for n, p in excluded],
            "quantized_nodes": len(quantized), "linear_nodes": len(nodes),
            "fp32_bytes": _size(source.parent), "bytes": _size(target.parent)}


#: bytes past which a serialised ONNX model fails (protobuf's 2 GB message limit), less a
#: margin for the graph itself
PROTOBUF_LIMIT = (2 << 30) - (64 << 20)


def convert_fp16(source: Path, target: Path, *, external: bool) -> dict:
    """Convert the fp32 graph to float16 (weights, activations, KV cache; logits stay float32)."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    large = _size(source.parent) > PROTOBUF_LIMIT
    if large:  # a graph past protobuf's 2 GB cannot be serialised whole for shape inference:
        # infer the shapes from the file (weights stay on disk), convert without inferring again
        inferred = source.parent / "inferred.onnx"
        onnx.shape_inference.infer_shapes_path(str(source), str(inferred))
        source_graph = inferred
    else:
        source_graph = source
    model = onnx.load(str(source_graph), load_external_data=True)
    with _quiet_root():
        converted = convert_float_to_float16(model, keep_io_types=list(FP16_KEEP_IO),
                                             disable_shape_infer=large)
    del model
    save_onnx(converted, target, external or large)
    return {"converter": "onnxruntime.transformers.float16", "kept_float32_io": list(FP16_KEEP_IO),
            "fp32_bytes": _size(source.parent), "bytes": _size(target.parent)}


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob(f"{ONNX_FILE}*"))


# ---------------------------------------------------------------------- drift
def _probabilities(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=-1, keepdims=True)
    return z


def _positions(case, rollout) -> np.ndarray:
    """Logits ``[P, V]`` at every real prompt position but the last, then every greedy step
    (the last prompt position is the first step)."""
    vocab = rollout.prefill.shape[-1]
    real = case.attention_mask.astype(bool)[:, :-1]
    return np.concatenate([rollout.prefill[:, :-1][real], rollout.next_logits.reshape(-1, vocab)])


def wilson_interval(hits: int, n: int, z: float = 1.959964) -> list[float]:
    """The 95% Wilson score interval of a proportion ``hits / n`` (positions are not
    independent draws, so read it as the least uncertainty the count carries)."""
    if n == 0:
        return [0.0, 1.0]
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [float(max(0.0, centre - half)), float(min(1.0, centre + half))]


def measure_drift(cases, base, variant) -> dict:
    """How far the variant's next-token distributions are from the fp32 engine's.

    ``base`` and ``variant`` are rollouts of ``cases`` (the variant replaying the base's
    or the reference's tokens). Probability changes are ``max_v |p'_v - p_v|`` per
    position; total variation is ``0.5 * sum_v |p'_v - p_v|``.
    """
    change, tv, agree, logit = [], [], [], 0.0
    for case, b, v in zip(cases, base, variant, strict=True):
        zb, zv = _positions(case, b), _positions(case, v)
        logit = max(logit, float(np.abs(zv - zb).max()))
        diff = np.abs(_probabilities(zv) - _probabilities(zb))
        change.append(diff.max(axis=-1))
        tv.append(0.5 * diff.sum(axis=-1))
        agree.append(zv.argmax(-1) == zb.argmax(-1))
    change, tv, agree = (np.concatenate(x) for x in (change, tv, agree))
    return {"positions": int(agree.size), "greedy_agreement": float(agree.mean()),
            "greedy_agreement_interval": wilson_interval(int(agree.sum()), int(agree.size)),
            "mean_total_variation": float(tv.mean()), "max_total_variation": float(tv.max()),
            "mean_prob_change": float(change.mean()), "max_prob_change": float(change.max()),
            "max_abs_logit_diff": logit,
            "compared_with": "the validated fp32 engine, same tokens, CPUExecutionProvider"}
