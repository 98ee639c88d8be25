"""The child side of benchmarks/engines.py's measurements: one arm's engine loaded in a
process of its own, warmed up and timed (``python _engines_worker.py JOB``, JOB a JSON object;
prints its result as JSON), and the prompts every arm reads."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from _engines_design import LONG_CONTEXTS


def profile_worker(job: dict) -> dict:
    from collections import Counter

    from calm_runtime.inference.lm import CalibratedLM

    folder, work = Path(job["folder"]), Path(job["path"]).parent
    lm = CalibratedLM.load(job["path"], threads=1, session_options={
        "enable_profiling": True, "profile_file_prefix": str(work / "ort-profile")})
    [(context, new_tokens)] = job["calls"]
    lm.generate(lm.tokenizer.decode(arm_prompts(folder)[context], skip_special_tokens=False),
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


def run_job(job: dict):
    """The child's side of :func:`measure_engine` and :func:`_op_profile`."""
    if job["runner"] == "profile":
        return profile_worker(job)
    folder, path, threads = Path(job["folder"]), Path(job["path"]), job["threads"]
    run = {"genai": genai_runner, "calm": calm_runner, "ort": ort_runner,
           "transformers": transformers_runner}[job["runner"]](
               folder if job["runner"] == "transformers" else path, threads)
    prompts = arm_prompts(folder)
    run(prompts[64], 2)
    return [run(prompts[context], new_tokens) for context, new_tokens in job["calls"]]


def calm_runner(path: Path, threads: int):
    from calm_runtime.inference.lm import CalibratedLM

    lm = CalibratedLM.load(path, threads=threads)

    def run(ids: list[int], new_tokens: int) -> tuple[float, float]:
        out = lm.generate(lm.tokenizer.decode(ids, skip_special_tokens=False), new_tokens)
        return out.timing.per_token_s, out.timing.prefill_s

    return run


def ort_runner(path: Path, threads: int):
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


def genai_runner(path: Path, threads: int):
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


def transformers_runner(folder: Path, threads: int):
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


def arm_prompts(folder: Path) -> dict[int, list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = ("The history of science is the study of the development of science and scientific "
            "knowledge, including both the natural and social sciences. ") * 256
    ids = tok.encode(text, add_special_tokens=False).ids
    return {n: ids[:n] for n in (64, 512, *LONG_CONTEXTS)}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(run_job(json.loads(sys.argv[1]))))
