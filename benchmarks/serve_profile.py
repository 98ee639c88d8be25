"""Where a busy `calm serve` spends its time: ONNX Runtime's op profile of one admission
prefill and of decode steps of a full batch, on the fp32 and int4 engines.

    python benchmarks/serve_profile.py --engines DIR     # the engines serve_vs_vllm.py made

What `calm serve` runs under load, through its own decode batch
(:class:`calm_runtime.inference.continuous.DecodeBatch`): ``--rows`` ARC-Easy prompts
admitted at one boundary (one prefill pass, what ``--max-step-prefill-tokens`` bounds), then
``--steps`` decode steps of all of them. Per engine and phase: wall seconds, and kernel time
per op type (ONNX Runtime's profiler, summed over the phase's passes). Writes
``OUT/serve_profile.{json,md}`` naming the command and the commit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from _common import command_line, git_commit

HERE = Path(__file__).resolve().parent


def profile(engine: Path, prompts: list[str], steps: int, threads: int | None) -> dict:
    from calm_runtime.inference.continuous import DecodeBatch
    from calm_runtime.inference.lm import CalibratedLM
    from calm_runtime.inference.sampling import DecodeOptions

    work = engine.parent / f"{engine.name}-profile"
    work.mkdir(exist_ok=True)
    lm = CalibratedLM.load(engine, threads=threads, session_options={
        "enable_profiling": True, "profile_file_prefix": str(work / "ort")})
    decode = DecodeOptions(ignore_eos=True)
    ids = [lm.encode_prompt(p) for p in prompts]
    specs = lm.generation_run(ids, steps + 1, decode=decode).row_specs()
    batch = DecodeBatch(lm.backend, lm.tokenizer)
    warm = DecodeBatch(lm.backend, lm.tokenizer)  # the arena and kernels warmed once
    warm.admit(specs, range(len(specs)))
    warm.clear()
    passes = []
    run = lm.backend.run

    def counted(*a, **k):
        passes.append(1)
        return run(*a, **k)
    lm.backend.run = counted
    marks = [time.perf_counter_ns() // 1000]
    batch.admit(specs, range(len(specs)))
    prefill_passes = len(passes)
    marks.append(time.perf_counter_ns() // 1000)
    for _ in range(steps):
        batch.choose()
        batch.advance()
    marks.append(time.perf_counter_ns() // 1000)
    trace = Path(lm.backend._session.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    # the last runs are ours: the admission's prefill passes (one per prompt length on a
    # packed engine), then the decode steps
    ours = runs[-(prefill_passes + steps):]
    phases = {"prefill": ours[:prefill_passes], "decode": ours[prefill_passes:]}
    out = {"tokens": sum(len(i) for i in ids), "rows": len(ids), "steps": steps,
           "prefill_passes": prefill_passes,
           "wall_s": {"prefill": (marks[1] - marks[0]) / 1e6,
                      "decode_per_step": (marks[2] - marks[1]) / 1e6 / steps}}
    for phase, group in phases.items():
        spans = [(r["ts"], r["ts"] + r["dur"]) for r in group]
        time_ = Counter()
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and any(
                    a <= e["ts"] <= b for a, b in spans):
                time_[e["args"]["op_name"]] += e["dur"]
        total = sum(time_.values()) or 1
        # per admission (all its passes) and per decode step
        per = 1 if phase == "prefill" else len(group)
        out[phase] = {op: {"ms": t / 1e3 / per, "share": t / total}
                      for op, t in time_.most_common(8)}
        out[f"{phase}_run_ms"] = sum(r["dur"] for r in group) / 1e3 / per
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=Path, required=True,
                        help="the folder serve_vs_vllm.py exported its engines to")
    parser.add_argument("--rows", type=int, default=8, help="prompts admitted at once")
    parser.add_argument("--decode-rows", type=int, default=32,
                        help="rows decoding together in the decode phase")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)

    from calm_runtime.data.prompts import cloze_context
    from calm_runtime.data.sets import load_dataset

    questions = [cloze_context(r.question) for r in load_dataset("arc-easy:test", install=True)]
    result = {}
    for name in ("fp32", "int4"):
        engine = args.engines / f"engine-{name}"
        result[name] = {"prefill_rows": profile(engine, questions[:args.rows], 1, args.threads),
                        "decode_rows": profile(engine, questions[:args.decode_rows], args.steps,
                                               args.threads)}
    payload = {"command": command_line("serve_profile.py", argv if argv is not None
                                       else sys.argv[1:]),
               "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "rows": args.rows, "decode_rows": args.decode_rows, "steps": args.steps,
               "engines": result}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_profile.json").write_text(json.dumps(payload, indent=1) + "\n")
    lines = [f"`{payload['command']}` at {payload['commit']} ({payload['date']})", "",
             "| engine | phase | wall | ORT runs | op: kernel ms (share) |",
             "|---|---|---|---|---|"]
    for name, runs in result.items():
        pre, dec = runs["prefill_rows"], runs["decode_rows"]
        for label, run, phase, wall in (
                (f"admission prefill, {pre['rows']} prompts ({pre['tokens']} tokens, "
                 f"{pre['prefill_passes']} passes)", pre, "prefill",
                 f"{pre['wall_s']['prefill'] * 1e3:.0f} ms"),
                (f"decode step, {dec['rows']} rows", dec, "decode",
                 f"{dec['wall_s']['decode_per_step'] * 1e3:.0f} ms")):
            ops = "; ".join(f"{op} {v['ms']:.1f} ({v['share']:.0%})"
                            for op, v in run[phase].items())
            lines.append(f"| {name} | {label} | {wall} | {run[phase + '_run_ms']:.0f} ms | "
                         f"{ops} |")
    (args.out / "serve_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
