"""docs/results.md's plain sentences on serving, read from the serving benchmarks' JSON
(benchmarks/serve_vs_vllm.py, benchmarks/serve_profile.py)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def serve_vs_vllm_reading() -> list[str]:
    """Plain sentences from results/serve_vs_vllm.json: calm serve fp32 over vLLM per cell,
    int4 over fp32, p99 time per output token at 32 clients, peak memory."""
    data = json.loads((RESULTS / "serve_vs_vllm.json").read_text())
    rows = data["rows"]
    if not any("ttft_p50" in r for r in rows):  # a file from before the streamed cells
        return []

    def key(r):
        return (r["max_tokens"], r.get("clients"), r.get("arrivals", "closed"))

    def cell(k):
        return (f"{k[0]} tokens × {k[1]} clients" if k[2] == "closed"
                else f"{k[0]} tokens, {k[2]} arrivals")
    by = {(r["server"], *key(r)): r for r in rows}
    cells = sorted({key(r) for r in rows}, key=lambda k: (k[2] != "closed", k[0], k[1] or 0))
    out = []

    def over(a: str, b: str) -> dict:
        """tokens/s of server ``a`` over server ``b``'s, per cell both ran."""
        return {k: by[(a, *k)]["tokens_per_s"] / by[(b, *k)]["tokens_per_s"] for k in cells
                if (a, *k) in by and (b, *k) in by}
    ratios = over("calm serve fp32", "vLLM fp32")
    if ratios:
        below = [k for k, v in ratios.items() if v < 1.0]
        out.append("calm serve fp32's tokens/s over vLLM fp32's: "
                   + "; ".join(f"{cell(k)} {v:.2f}x" for k, v in ratios.items()) + ". "
                   + ("It is at or above vLLM on every cell." if not below else
                      f"Below vLLM on {len(below)} of {len(ratios)} cells: "
                      + ", ".join(cell(k) for k in below) + "."))
    for k in [k for k, v in ratios.items() if v < 1.0]:
        mine, theirs = by[("calm serve fp32", *k)], by[("vLLM fp32", *k)]
        first = mine["ttft_p50"] / theirs["ttft_p50"]
        later = mine["tpot_p50"] / theirs["tpot_p50"]
        side = ("the prefill of a wave of prompts, not the decode, decides it"
                if first > 1.0 >= later else
                "the decode steps decide it" if later > 1.0 >= first else
                "both its prefill and its decode steps are slower there")
        out.append(f"At {cell(k)}, calm's p50 time to first token is {mine['ttft_p50']:.2f} "
                   f"against vLLM's {theirs['ttft_p50']:.2f} s and its p50 time per output "
                   f"token {mine['tpot_p50'] * 1e3:.0f} against {theirs['tpot_p50'] * 1e3:.0f} "
                   f"ms: {side}.")
    for mine in ("calm serve int4", "calm serve fp32"):  # int4: the GGUF's own blocks
        llama = over(mine, "llama-server Q4_1")
        if llama:
            out.append(f"{mine} over llama-server on the same Q4_1 GGUF: "
                       + "; ".join(f"{cell(k)} {v:.2f}x" for k, v in llama.items()) + ".")
    int4 = over("calm serve int4", "calm serve fp32")
    if int4:
        below = [k for k, v in int4.items() if v < 1.0]
        out.append("int4 over fp32 (calm serve): "
                   + "; ".join(f"{cell(k)} {v:.2f}x" for k, v in int4.items()) + "."
                   + ("" if not below else f" Below fp32 on {', '.join(map(cell, below))}."))
    tpot = [(k, by[("calm serve fp32", *k)]["tpot_p99"], by[("vLLM fp32", *k)]["tpot_p99"])
            for k in cells if k[1] == 32 and ("calm serve fp32", *k) in by
            and ("vLLM fp32", *k) in by]
    if tpot:
        out.append("p99 time per output token at 32 clients, calm serve fp32 vs vLLM fp32: "
                   + "; ".join(f"{k[0]} tokens {a * 1e3:.0f} vs {b * 1e3:.0f} ms"
                               for k, a, b in tpot) + ".")
    if data.get("peak_rss_mb"):
        out.append("Peak RSS of each server over the whole run: "
                   + ", ".join(f"{k} {v:.0f} MB" for k, v in data["peak_rss_mb"].items()) + ".")
    return [" ".join(out)] if out else []


def serve_profile_reading() -> list[str]:
    """The int4 engine's matrix products against fp32's per pass, from serve_profile.json."""
    data = json.loads((RESULTS / "serve_profile.json").read_text())["engines"]
    out, slower = [], []
    for phase, key in (("prefill", "prefill_rows"), ("decode", "decode_rows")):
        fp32, int4 = data["fp32"][key], data["int4"][key]
        mm = fp32[phase].get("MatMul", {}).get("ms")
        nbits = int4[phase].get("MatMulNBits", {}).get("ms")
        wall = ("prefill" if phase == "prefill" else "decode_per_step")
        if mm and nbits:
            out.append(f"{'One admission prefill' if phase == 'prefill' else 'One decode step'} "
                       f"of {fp32['rows']} rows: int4 {int4['wall_s'][wall] * 1e3:.0f} ms against "
                       f"fp32 {fp32['wall_s'][wall] * 1e3:.0f} ms, its MatMulNBits "
                       f"{nbits:.1f} ms against fp32's MatMul {mm:.1f} ms.")
            slower.append(nbits > mm)
            extra = {op: v["ms"] for op, v in int4[phase].items()
                     if op not in fp32[phase] and op != "MatMulNBits"}
            if extra:
                out.append(f"The int4 graph's own extra ops there ({', '.join(extra)}: the "
                           f"GGUF blocks' minimums, applied outside MatMulNBits as block sums "
                           f"of its input) take {sum(extra.values()):.1f} ms.")
    if slower and all(slower):
        out.append("The int4 engine reads a quarter of the weight bytes, which wins where a "
                   "step is bound by reading the weights (few rows); with many rows a step is "
                   "bound by arithmetic, and ONNX Runtime's 4-bit kernel (activations "
                   "quantised per block, int8 products) does that arithmetic slower than its "
                   "fp32 GEMM here (the profile above, at these row counts).")
    return [" ".join(out)] if out else []
