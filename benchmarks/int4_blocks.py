"""The int4 engine's block size and what 4 bits cost, measured on an fp32 calm engine.

    python benchmarks/int4_blocks.py --engine engines/smol      # an fp32 engine (calm-export)

For each setting (int4 with blocks of 16, 32, 64 and 128 weights, and calm's default int8 for
comparison; every MatMul, symmetric, ``accuracy_level`` 4 = int8 compute, as
``calm-export --quantize`` builds them) the engine's ``model.onnx`` is quantised with
``calm_export.quantize`` into a copy of the engine, and compared with the fp32 engine at
every position of ``calm_export.quantize.DRIFT_PROMPTS`` plus a few scoring prompts (top-1
agreement, mean total variation of the next-token distribution) and timed on 32 greedy
tokens after each prompt (1 thread, median ms/token over the prompts). The size is the
graph's bytes. Writes ``results/int4_blocks.{json,md}`` naming the command and the commit.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import command_line, git_commit

from calm_export import ExportConfig, quantize
from calm_runtime.lm import CalibratedLM

HERE = Path(__file__).resolve().parent
STEM = "int4_blocks"
PROMPTS = (*quantize.DRIFT_PROMPTS,
           "Question: What gas do plants absorb from the air?\nAnswer:",
           "Question: Which planet is closest to the sun?\nA. Venus\nB. Mercury\nC. Mars\n"
           "D. Earth\nAnswer:")
SETTINGS = (("int4", 16), ("int4", 32), ("int4", 64), ("int4", 128), ("int8", 32))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, help="an fp32 engine folder (calm-export)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens timed per prompt")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    engine = Path(args.engine)
    fp32 = CalibratedLM.load(engine, threads=1)
    base = [_logits(fp32, p) for p in PROMPTS]
    rows = [{"setting": "fp32", "bytes": _size(engine), "ms_per_token": _speed(fp32, args.tokens),
             "top1_agreement": 1.0, "mean_total_variation": 0.0}]
    fp32.close()
    for kind, block in SETTINGS:
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / "engine"
            shutil.copytree(engine, copy, ignore=shutil.ignore_patterns("model.onnx*"))
            config = (ExportConfig(quantize="int4", int4_block_size=block) if kind == "int4"
                      else ExportConfig(quantize="int8", int8_block_size=block))
            fn = quantize.quantize_int4 if kind == "int4" else quantize.quantize_int8
            fn(engine / "model.onnx", copy / "model.onnx", config, external=False)
            lm = CalibratedLM.load(copy, threads=1, verify_hashes=False)
            agree, tv = [], []
            for want, prompt in zip(base, PROMPTS, strict=True):
                got = _logits(lm, prompt)
                agree.append(got.argmax(-1) == want.argmax(-1))
                tv.append(0.5 * np.abs(_softmax(got) - _softmax(want)).sum(-1))
            rows.append({"setting": f"{kind} block {block}", "bytes": _size(copy),
                         "ms_per_token": _speed(lm, args.tokens),
                         "top1_agreement": float(np.concatenate(agree).mean()),
                         "mean_total_variation": float(np.concatenate(tv).mean()),
                         "positions": int(np.concatenate(agree).size)})
            lm.close()
    result = {"command": command_line("int4_blocks.py", argv), "commit": git_commit(),
              "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "engine": str(engine), "rows": rows}
    out = HERE / "results"
    (out / f"{STEM}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{STEM}.md").write_text(render(result))
    print(render(result))
    return 0


def _logits(lm: CalibratedLM, prompt: str) -> np.ndarray:
    ids = lm.tokenizer.encode(prompt)
    batch = np.asarray([ids], dtype=np.int64)
    logits, _ = lm.backend.run(batch, np.ones_like(batch),
                               np.arange(len(ids), dtype=np.int64)[None], None)
    return np.asarray(logits[0], dtype=np.float64)


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _speed(lm: CalibratedLM, tokens: int) -> float:
    times = []
    for prompt in PROMPTS:
        out = lm.generate(prompt, tokens)
        times.append(out.timing.per_token_s * 1e3)
    return float(statistics.median(times))


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("model.onnx*"))


def render(result: dict) -> str:
    lines = ["# int4 block size: drift and speed against the fp32 engine", "",
             f"Generated by `{result['command']}` at commit {result['commit']} on "
             f"{result['created']}; do not edit by hand. Engine: `{result['engine']}`.", "",
             "| setting | MB | ms/token (1 thread) | top-1 agreement | mean total variation |",
             "|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['setting']} | {row['bytes'] / 1e6:.0f} | "
                     f"{row['ms_per_token']:.1f} | {row['top1_agreement']:.3f} | "
                     f"{row['mean_total_variation']:.4f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
