"""Latency benchmark (batch 1, fixed threads): calm's runtime against its peers, one process.

    python benchmarks/latency.py --engine ENGINE_DIR [--threads 1] [--tokens 32] [--rounds 5]

Contenders, alternated round by round so machine noise hits all alike (compare ratios):

* ``transformers``: ``model.generate()`` on the source model in torch (fp32, greedy);
* ``calm-onnxruntime``: :class:`calm_runtime.CalibratedLM` on the fused engine, greedy,
  with per-token calibrated confidences and entropies;
* ``onnxruntime-genai``: the same engine folder run by onnxruntime-genai (the peer), when
  it is installed.

Also measured: the cost of the confidence computation itself (``step_stats`` on the
engine's real next-token logits), as a share of calm's per-token time. Reports prefill
and per-token median / p90 and tokens/s; writes ``results/latency.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from _common import git_commit

HERE = Path(__file__).resolve().parent
PROMPT = "Once upon a time, in a small village by the sea,"


def _summary(per_token: list[float], prefill: list[float], tokens: int) -> dict:
    ordered = sorted(per_token)
    median = statistics.median(ordered)
    return {"per_token_ms_median": 1e3 * median,
            "per_token_ms_p90": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
            "prefill_ms_median": 1e3 * statistics.median(prefill),
            "tokens_per_s": 1.0 / median if median else None, "tokens": tokens}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, help="engine directory from calm-export")
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="the engine's source model, for the transformers contender")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results" / "latency.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from calm_runtime import CalibratedLM
    from calm_runtime.models import resolve_model
    from calm_runtime.sampling import step_stats

    torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    lm = CalibratedLM.load(args.engine, backend="onnxruntime", threads=args.threads)
    genai = _genai(args.engine, args.threads)

    samples = {name: {"per_token": [], "prefill": []} for name in
               ["transformers", "calm-onnxruntime"] + (["onnxruntime-genai"] if genai else [])}
    ids = tokenizer(PROMPT, return_tensors="pt")
    for _ in range(args.rounds):
        # transformers generate(): prefill = 1 new token; per token from the difference
        with torch.inference_mode():
            start = time.perf_counter()
            model.generate(**ids, max_new_tokens=1, do_sample=False, min_new_tokens=1)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(**ids, max_new_tokens=args.tokens, do_sample=False,
                           min_new_tokens=args.tokens)
            total = time.perf_counter() - start
        samples["transformers"]["prefill"].append(prefill)
        samples["transformers"]["per_token"].append((total - prefill) / (args.tokens - 1))
        out = lm.generate(PROMPT, max_new_tokens=args.tokens)
        samples["calm-onnxruntime"]["prefill"].append(out.timing.prefill_s)
        samples["calm-onnxruntime"]["per_token"].append(out.timing.per_token_s)
        if genai:
            prefill, per_token = genai(tokenizer(PROMPT)["input_ids"], args.tokens)
            samples["onnxruntime-genai"]["prefill"].append(prefill)
            samples["onnxruntime-genai"]["per_token"].append(per_token)

    # the confidence computation alone, on real next-token logits of the engine
    logits = _engine_logits(lm, tokenizer(PROMPT)["input_ids"])
    reps = 200
    start = time.perf_counter()
    for _ in range(reps):
        step_stats(logits)
    confidence_s = (time.perf_counter() - start) / reps

    results = {name: _summary(s["per_token"], s["prefill"], args.tokens)
               for name, s in samples.items()}
    calm = results["calm-onnxruntime"]["per_token_ms_median"]
    results["ratios"] = {
        "transformers_over_calm": results["transformers"]["per_token_ms_median"] / calm,
        "confidence_ms_per_token": 1e3 * confidence_s,
        "confidence_share_of_calm_token": 1e3 * confidence_s / calm,
    }
    if genai:
        results["ratios"]["calm_over_genai"] = (
            calm / results["onnxruntime-genai"]["per_token_ms_median"])
    results["settings"] = {"threads": args.threads, "tokens": args.tokens,
                           "rounds": args.rounds, "batch": 1, "engine": str(args.engine),
                           "command": "python benchmarks/latency.py " + " ".join(
                               argv if argv is not None else sys.argv[1:]),
                           "commit": git_commit()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    for name, row in results.items():
        if name not in ("ratios", "settings"):
            print(f"{name:<20} prefill {row['prefill_ms_median']:7.1f} ms   per token "
                  f"{row['per_token_ms_median']:6.1f} ms (p90 {row['per_token_ms_p90']:6.1f})"
                  f"   {row['tokens_per_s']:.1f} tokens/s")
    print(json.dumps(results["ratios"], indent=1))
    return 0


def _engine_logits(lm, prompt_ids) -> np.ndarray:
    """The engine's real next-token logits ``[1, V]`` after the prompt (one prefill)."""
    ids = np.asarray([prompt_ids], dtype=np.int64)
    mask = np.ones_like(ids)
    positions = np.arange(ids.shape[1], dtype=np.int64)[None, :]
    logits, _ = lm.backend.run(ids, mask, positions, None, last_only=True)
    return logits[:, -1]


def _genai(engine: str, threads: int):
    try:
        import onnxruntime_genai as og
    except ImportError:
        return None
    config = og.Config(engine)
    model = og.Model(config)

    def run(prompt_ids, tokens):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt_ids) + tokens, do_sample=False)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(prompt_ids)
        generator.generate_next_token()
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        steps = 0
        while not generator.is_done() and steps < tokens - 1:
            generator.generate_next_token()
            steps += 1
        return prefill, (time.perf_counter() - start) / max(steps, 1)

    _ = threads  # genai takes its thread count from genai_config.json's session options
    return run




if __name__ == "__main__":
    sys.exit(main())
