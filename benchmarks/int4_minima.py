"""What carrying a GGUF's block minima exactly costs calm's int4 engine per decode step.

    python benchmarks/int4_minima.py --model smollm2-135m-instruct --rounds 6 --llama-cpp DIR

A GGUF block with a minimum (Q4_1, Q4_K, Q5_1, Q5_K: ``w = scale * k + min``) is carried as
``MatMulNBits(X) + S M`` (docs/formats.md): ``S`` sums each block of the input (a Reshape and
a ReduceSum per input), ``M`` holds the minima as float32 (a MatMul and an Add per carried
node). ONNX Runtime's MatMulNBits could take the minimum as a float zero point, but only on a
dequantising path (the single-node table below), so the term costs nodes and bytes of its own.

Arms, each in a process of its own per round, rotated (benchmarks/engines.py's bare ONNX
Runtime loop for the two graphs, ``llama-bench`` for the GGUF): the int4 engine as
``calm-export --quantize int4`` writes it; the same graph with every minimum term taken out
(a bound, not an engine: its outputs are wrong, and it reads no minima, so an int8 kernel
that took the minima inside its own pass could come near it but not beat it); and llama.cpp
on the same GGUF (with ``--llama-cpp DIR``). Decode ms per token over ``--new-tokens``
greedy tokens after a 64-token prompt, on
each of ``--threads``. A model whose carried blocks have no minima has nothing to take out
(gemma-3-270m's Q4_K_M tensors are stored as Q5_0, Q8_0 and Q6_K, none with a minimum).
Each run adds (or replaces) its model's section of ``results/int4_minima.{json,md}``,
naming the command and the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import _llama_cpp
import engines
import numpy as np
import onnx
import onnxruntime
from _common import command_line, git_commit, write_model_section

from calm_export.gguf_blocks import MINIMUM_ADD
from calm_export.graphs.calm_graph import ONNX_FILE

HERE = Path(__file__).resolve().parent
STEM = "int4_minima"
EXPORTED, BOUND = "calm int4", "calm int4, minima taken out (a bound)"


def without_minima(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """``model`` with every carried node's block-minimum term taken out: each
    ``MINIMUM_ADD`` Add is bypassed (its MatMulNBits writes the Add's output) and the nodes
    nothing reads any more are dropped. Returns the model and ``{"nodes": removed node
    count by type, "minima_bytes": bytes of the float32 minima no node reads}``."""
    graph = model.graph
    adds = {n.name: n for n in graph.node if n.name.endswith(MINIMUM_ADD)}
    if not adds:
        return model, {"nodes": {}, "minima_bytes": 0}
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
           for n in graph.node for a in n.attribute):
        raise ValueError("the graph has subgraphs (If, Loop, Scan): the minima are taken out "
                         "of flat graphs only")
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for add in adds.values():
        source = producer[add.input[0]]
        if source.op_type != "MatMulNBits" or readers[add.input[0]] != 1:
            raise ValueError(f"{add.name} does not add to a MatMulNBits output that only it "
                             "reads")
        source.output[0] = add.output[0]
    nodes = [n for n in graph.node if n.name not in adds]
    wanted = {o.name for o in graph.output}
    kept: list = []
    for node in reversed(nodes):  # the graph is in topological order
        if any(o in wanted for o in node.output):
            kept.append(node)
            wanted.update(node.input)
    kept.reverse()
    kept_ids = {id(node) for node in kept}
    removed: dict[str, int] = {}
    for node in graph.node:
        if id(node) not in kept_ids:
            removed[node.op_type] = removed.get(node.op_type, 0) + 1
    inits = {i.name: i for i in graph.initializer}
    orphans = [name for name in inits if name not in wanted]
    minima = sum(int(np.prod(inits[n].dims)) * 4 for n in orphans
                 if inits[n].data_type == onnx.TensorProto.FLOAT and n.endswith(".gguf_minima"))
    del graph.node[:]
    graph.node.extend(kept)
    kept_inits = [inits[n] for n in inits if n in wanted]
    del graph.initializer[:]
    graph.initializer.extend(kept_inits)
    return model, {"nodes": removed, "minima_bytes": minima}


def bound_folder(engine: Path, model: onnx.ModelProto, out: Path) -> dict:
    """``out``: a copy of the engine folder with ``model`` (its graph, loaded without the
    weights; changed in place) less its minima (the weights' file linked, not copied, where
    the file system allows). Returns :func:`without_minima`'s counts."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for path in engine.iterdir():
        if path.name == ONNX_FILE:
            continue
        try:
            os.link(path, out / path.name)
        except OSError:
            shutil.copy2(path, out / path.name)
    model, counts = without_minima(model)
    onnx.save(model, str(out / ONNX_FILE))
    return counts


def zero_point_timings(k: int, n: int, block: int = 32, calls: int = 300) -> dict:
    """Microseconds of one MatMulNBits (4 bits, ``accuracy_level`` 4, one input row, 1
    thread) of ``k`` inputs and ``n`` outputs: without zero points (calm's carried form),
    with 4-bit integer zero points, and with float zero points (a block minimum's exact
    form). Median of five timings of ``calls`` calls each."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    blocks = k // block
    codes = rng.integers(0, 16, (n, blocks, block)).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = rng.uniform(0.01, 0.02, n * blocks).astype(np.float32)
    zero_points = {
        "none": None,
        "integer": np.full(n * ((blocks + 1) // 2), 0x88, np.uint8),
        "float": rng.uniform(8.0, 12.0, n * blocks).astype(np.float32)}
    x = {"A": rng.standard_normal((1, k)).astype(np.float32)}
    out = {}
    for kind, zp in zero_points.items():
        inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "S")]
        if zp is not None:
            inits.append(numpy_helper.from_array(zp, "Z"))
        node = helper.make_node("MatMulNBits",
                                ["A", "B", "S"] + (["Z"] if zp is not None else []), ["Y"],
                                domain="com.microsoft", K=k, N=n, bits=4, block_size=block,
                                accuracy_level=4)
        graph = helper.make_graph(
            [node], "one", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, k])],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, n])], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)])
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
        session = onnxruntime.InferenceSession(model.SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        for _ in range(20):
            session.run(None, x)
        timings = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(calls):
                session.run(None, x)
            timings.append((time.perf_counter() - started) / calls * 1e6)
        out[kind] = statistics.median(timings)
    return out


def _first_minimum_node(model: onnx.ModelProto) -> tuple[int, int] | None:
    """(K, N) of the first carried node with a block minimum, if any."""
    producer = {o: n for n in model.graph.node for o in n.output}
    for node in model.graph.node:
        if node.name.endswith(MINIMUM_ADD):
            source = producer[node.input[0]]
            attrs = {a.name: a.i for a in source.attribute}
            return attrs["K"], attrs["N"]
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", default="1,2",
                        help="comma-separated thread counts, each its own set of rounds")
    parser.add_argument("--llama-cpp", metavar="DIR",
                        help="a folder with llama.cpp's llama-bench (and llama-server): adds "
                             "llama-bench on the model's own GGUF as an arm")
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the .json")
    args = parser.parse_args(argv)
    out = HERE / "results"
    if args.render:
        (out / f"{STEM}.md").write_text(render(json.loads((out / f"{STEM}.json").read_text())))
        return 0
    threads = [int(t) for t in args.threads.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    folder, work = engines.model_and_work(args.model)
    build = engines.build_all(folder, args.model, work, only={EXPORTED})[EXPORTED]
    engine = Path(build["path"])
    model = onnx.load(str(engine / ONNX_FILE), load_external_data=False)
    shape = _first_minimum_node(model)
    counts = bound_folder(engine, model, work / "calm-int4-no-minima")
    if not counts["nodes"]:
        raise SystemExit(f"{args.model}'s int4 engine carries no block minima: nothing to "
                         "take out (the module's docstring says which GGUF types have them)")
    arms = {EXPORTED: build, BOUND: {"path": str(work / "calm-int4-no-minima")}}
    llama = None
    if args.llama_cpp:
        source = engines.model_gguf(args.model, work)
        llama = (f"llama.cpp {engines.dominant_type(source)} GGUF", source,
                 _llama_cpp.binaries(args.llama_cpp)["bench"])
    names = [*arms, *([llama[0]] if llama else [])]
    load_before = os.getloadavg()
    per_threads = []
    for count in threads:
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                if llama and name == llama[0]:
                    decode = _llama_cpp.bench(llama[2], llama[1], args.new_tokens,
                                              threads=count, prefill=())["decode"]
                else:
                    [(decode, _)] = engines.measure_engine(name, arms[name], folder, None,
                                                      [(64, args.new_tokens)], threads=count,
                                                      runner="ort")
                times[name].append(decode)
            print(f"{count} thread(s), round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {v[-1] * 1e3:.1f} ms/token" for n, v in times.items()), flush=True)
        against = llama[0] if llama else EXPORTED
        per_threads.append({
            "threads": count,
            "ms_per_token": {n: [round(v * 1e3, 3) for v in vs] for n, vs in times.items()},
            "against": against,
            "pairs": {n: engines.paired(times[n], times[against]) for n in names}})
    section = {"command": command_line("int4_minima.py", argv), "commit": git_commit(),
               "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "model": args.model, "rounds": args.rounds, "new_tokens": args.new_tokens,
               "onnxruntime": onnxruntime.__version__, "removed_nodes": counts["nodes"],
               "minima_mb": round(counts["minima_bytes"] / 1e6, 2),
               "runs": per_threads,
               "single_node": ({"K": shape[0], "N": shape[1],
                                "us": zero_point_timings(*shape)} if shape else None),
               "load": {"before": [round(x, 2) for x in load_before],
                        "after": [round(x, 2) for x in os.getloadavg()]}}
    print(write_model_section(out, STEM, args.model, section, render))
    return 0


def render(result: dict) -> str:
    lines = ["# What the exact block minima cost calm's int4 engine", "",
             "Generated by `benchmarks/int4_minima.py` (one run per model, commands below); "
             "do not edit by hand. Decode ms per token after a 64-token prompt (batch 1; "
             "the two ONNX graphs in a bare ONNX Runtime loop), each arm in a process of its "
             "own per round, rotated; ratio = the arm's time over the reference arm's in the "
             "same round (median, min-max): llama.cpp's where it ran, else the exported "
             "engine's. The bound is the exported graph with every block-minimum term taken "
             "out: its outputs are wrong and it reads no minima, so a kernel taking the "
             "minima inside its own pass could come near it but not beat it.", ""]
    for model, s in result["models"].items():
        removed = ", ".join(f"{n} {t}" for t, n in sorted(s["removed_nodes"].items()))
        lines += [f"## {model}", "",
                  f"`{s['command']}` at commit {s['commit']} on {s['created']}: "
                  f"{s['rounds']} rounds of {s['new_tokens']} tokens, onnxruntime "
                  f"{s.get('onnxruntime', '(not recorded)')}. Taken out per decode step: "
                  f"{removed} nodes and {s['minima_mb']:.1f} MB of float32 minima. Reference "
                  f"arm: {s['runs'][0]['against']}.", "",
                  "| threads | arm | ms/token | ratio | min-max |", "|---|---|---|---|---|"]
        for run in s["runs"]:
            for name, values in run["ms_per_token"].items():
                pair = run["pairs"][name]
                lines.append(f"| {run['threads']} | {name} | {statistics.median(values):.2f} | "
                             f"{pair['ratio_median']:.3f} | {pair['ratio_min']:.3f}-"
                             f"{pair['ratio_max']:.3f} |")
        one = s.get("single_node")
        if one:
            us = one["us"]
            lines += ["", f"One MatMulNBits of this engine's shape (K {one['K']}, N "
                      f"{one['N']}, 4 bits, blocks of 32, accuracy level 4, one row, 1 "
                      "thread), microseconds per call:", "",
                      "| zero points | us | over none |", "|---|---|---|"]
            for kind, label in (("none", "none (calm's carried form)"),
                                ("integer", "4-bit integers"),
                                ("float", "float (a block minimum exactly)")):
                lines.append(f"| {label} | {us[kind]:.1f} | {us[kind] / us['none']:.2f} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
