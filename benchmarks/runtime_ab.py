"""calm's runtime against onnxruntime-genai's generator on the very same engine folder: the
per-step decode time of each, paired by round, with the power to read a few percent.

    python benchmarks/runtime_ab.py --model smollm2-135m-instruct --rounds 16
    python benchmarks/runtime_ab.py --model gemma-3-270m --rounds 12
    python benchmarks/runtime_ab.py --model gemma-3-270m --rounds 12 --huge-pages

The engine is ``calm-export``'s default fp32 graph (onnxruntime-genai's builder graph with the
calibration in its head), built as benchmarks/engines.py builds it (and cached with its
builds); onnxruntime-genai runs a copy of the folder. Each round runs three arms in rotated
order, each in a process of its own (benchmarks/engines.py's worker: loaded, warmed up with
one short call, then a 64-token prompt and ``--new-tokens`` greedy tokens on 1 thread): calm's
runtime, genai's generator, and a bare ONNX Runtime loop on the same folder (:data:`BARE`),
which splits the difference into calm's own per-step work and the process's. The verdict
divides calm's decode ms/step by genai's. The host's own drift between processes (±10% on
one arm here) is larger than the difference being judged, so the verdict rests on many
rounds: the median ratio with a distribution-free 95% interval (order statistics of the
paired ratios) and the number of rounds calm was faster. Each run adds (or replaces) its
model's section of ``results/runtime_ab.{json,md}``, naming the command and the commit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import engines
from _common import command_line, git_commit, write_model_section

HERE = Path(__file__).resolve().parent
STEM = "runtime_ab"
ARM, AGAINST = "calm fp32", "calm fp32 run by genai"
#: the third arm: a bare ONNX Runtime loop on the same folder (benchmarks/engines.py's
#: ``ort_runner`` of _engines_worker), which splits calm's runtime's cost from the process's
BARE = "bare onnxruntime loop"
#: the pairs reported beside the verdict: (numerator, denominator)
PAIRS = ((ARM, BARE), (BARE, AGAINST))


def median_interval(values: list[float], level: float = 0.95) -> list[float]:
    """A distribution-free interval for the median of ``values``: the widest-inside order
    statistics ``(x_(k), x_(n-k+1))`` whose binomial(n, 1/2) coverage is at least ``level``
    (the whole range when ``n`` is too small for it)."""
    x, n = sorted(values), len(values)
    best = [x[0], x[-1]]
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n
        if coverage < level:
            break
        best = [x[k - 1], x[n - k]]
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--huge-pages", action="store_true",
                        help="run every arm's process with glibc's malloc on transparent huge "
                             "pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1): the weights "
                             "ONNX Runtime packs at load then sit on 2 MB pages whatever the "
                             "process did before, which takes out a swing of up to ~8%% per "
                             "decode step between sessions (Linux, THP in madvise or always "
                             "mode); reported as its own row, MODEL (huge pages)")
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the .json")
    args = parser.parse_args(argv)
    out = HERE / "results"
    path = out / f"{STEM}.json"
    if args.render:
        (out / f"{STEM}.md").write_text(render(json.loads(path.read_text())))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.huge_pages:  # read by glibc when each arm's process starts
        os.environ["GLIBC_TUNABLES"] = huge_page_tunables(os.environ.get("GLIBC_TUNABLES"))
    folder, work = engines.model_and_work(args.model)
    build = engines.build_all(folder, args.model, work, only={ARM})[ARM]
    copy = engines.genai_copies({AGAINST: {**build, "runner": "genai"}})[AGAINST]
    arms = (ARM, AGAINST, BARE)
    times: dict[str, list[float]] = {name: [] for name in arms}
    load_before = os.getloadavg()
    for r in range(args.rounds):
        for name in arms[r % 3:] + arms[:r % 3]:
            [(decode, _)] = engines.measure_engine(name, build, folder,
                                              copy if name == AGAINST else None,
                                              [(64, args.new_tokens)],
                                              runner="ort" if name == BARE else None)
            times[name].append(decode)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {v[-1] * 1e3:.1f} ms/step" for n, v in times.items()), flush=True)
    ratios = [a / b for a, b in zip(times[ARM], times[AGAINST], strict=True)]
    section = {"command": command_line("runtime_ab.py", argv), "commit": git_commit(),
               "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "model": args.model, "rounds": args.rounds, "new_tokens": args.new_tokens,
               "threads": 1, "huge_pages": args.huge_pages, "arm": ARM, "against": AGAINST,
               "ms_per_step": {n: [round(v * 1e3, 3) for v in vs] for n, vs in times.items()},
               "ratios": [round(x, 4) for x in ratios],
               "ratio_median": statistics.median(ratios),
               "ratio_interval": median_interval(ratios),
               "calm_faster_rounds": sum(x < 1 for x in ratios),
               "pairs": [_pair(times, a, b) for a, b in PAIRS],
               "load": {"before": [round(x, 2) for x in load_before],
                        "after": [round(x, 2) for x in os.getloadavg()]}}
    key = f"{args.model} (huge pages)" if args.huge_pages else args.model
    print(write_model_section(out, STEM, key, section, render))
    return 0


def huge_page_tunables(current: str | None) -> str:
    """``GLIBC_TUNABLES`` with malloc's transparent huge pages on (``glibc.malloc.hugetlb=1``),
    keeping the caller's other tunables and replacing an earlier ``hugetlb`` value."""
    kept = [t for t in (current or "").split(":")
            if t and not t.startswith("glibc.malloc.hugetlb=")]
    return ":".join([*kept, "glibc.malloc.hugetlb=1"])


def _pair(times: dict, arm: str, against: str) -> dict:
    ratios = [a / b for a, b in zip(times[arm], times[against], strict=True)]
    return {"arm": arm, "against": against, "ratio_median": statistics.median(ratios),
            "ratio_interval": median_interval(ratios),
            "below_one": sum(x < 1 for x in ratios)}


def render(result: dict) -> str:
    lines = ["# calm's runtime against onnxruntime-genai's on the same engine", "",
             "Generated by `benchmarks/runtime_ab.py` (one run per model, commands below); do "
             "not edit by hand. Decode ms per step on 1 thread, batch 1, each arm in a process "
             "of its own, alternated; ratio = calm's runtime over genai's in the same round, "
             "median with its distribution-free 95% interval.", "",
             "| model | command | commit | rounds | calm ms/step | genai ms/step | ratio | "
             "95% interval | rounds calm faster |", "|---|---|---|---|---|---|---|---|---|"]
    for model, s in result["models"].items():
        low, high = s["ratio_interval"]
        lines.append(
            f"| {model} | `{s['command']}` | {s['commit']} | {s['rounds']} | "
            f"{statistics.median(s['ms_per_step'][s['arm']]):.1f} | "
            f"{statistics.median(s['ms_per_step'][s['against']]):.1f} | "
            f"{s['ratio_median']:.3f} | {low:.3f}-{high:.3f} | "
            f"{s['calm_faster_rounds']} of {s['rounds']} |")
    split = [(model, s) for model, s in result["models"].items() if s.get("pairs")]
    if split:
        lines += ["", f"Where the difference lies: a third arm, {BARE} (ONNX Runtime's Python "
                  "API on the same folder and session options, the KV cache read and written "
                  "in place, greedy argmax and nothing else), in the same rotated rounds. "
                  "calm's runtime over it is what calm adds on the same API: its per-step work "
                  "(the vocabulary's probabilities, the confidence, the text) and whatever its "
                  "loading leaves the process with; it over genai's is the Python API's "
                  "process against onnxruntime-genai's.", "",
                  "| model | arm | against | ms/step | ratio | 95% interval | rounds below 1 |",
                  "|---|---|---|---|---|---|---|"]
        for model, s in split:
            for p in s["pairs"]:
                low, high = p["ratio_interval"]
                lines.append(
                    f"| {model} | {p['arm']} | {p['against']} | "
                    f"{statistics.median(s['ms_per_step'][p['arm']]):.1f} | "
                    f"{p['ratio_median']:.3f} | {low:.3f}-{high:.3f} | "
                    f"{p['below_one']} of {s['rounds']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
