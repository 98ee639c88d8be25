"""Scoring benchmark: questions/s of the torch path and of an exported engine, same questions.

    python benchmarks/scoring.py --pair smollm2-135m-instruct=ENGINE [--pair gemma-3-270m=ENGINE]
        [--data arc-easy] [--limit 200] [--modes cloze letter] [--threads 1] [--rounds 3]

``calm fit`` and ``calm eval`` score every question of a data set with both models before
anything is fitted; this measures that step both ways ``calm_training.scoring.local`` runs it:
with the source model in torch (eager, ``logits_to_keep``, each cloze context once with its
KV cache shared by the options), and with the model's engine folder given as the model
(ONNX Runtime, the same token ids and the same shared-prefix cloze passes). Each pair is an
engine exported without an adapter and its source model, so the two paths compute the same
scores; the largest difference between them is reported next to the speed. Rounds alternate
the two paths; the speed is the median over rounds of questions per second, and the ratio
is the median of the per-round ratios. Writes ``results/scoring.json`` and ``scoring.md``.
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
from _common import command_line, git_commit

from calm_runtime.data.prompts import CHOICE_MODES

HERE = Path(__file__).resolve().parent
logger = logging.getLogger("scoring")


def _pair(text: str) -> tuple[str, Path]:
    model, sep, engine = text.partition("=")
    if not sep or not model or not engine:
        raise argparse.ArgumentTypeError(f"--pair takes MODEL=ENGINE_DIR, got {text!r}")
    return model, Path(engine)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  calm-export --model smollm2-135m-instruct --out engines/plain\n"
               "  python benchmarks/scoring.py --pair smollm2-135m-instruct=engines/plain")
    parser.add_argument("--pair", type=_pair, action="append", required=True,
                        help="MODEL=ENGINE: a model spec and its engine exported without an "
                             "adapter (repeatable)")
    parser.add_argument("--data", default="arc-easy")
    parser.add_argument("--limit", type=int, default=200, help="first N questions of the data")
    parser.add_argument("--modes", nargs="+", default=list(CHOICE_MODES),
                        choices=list(CHOICE_MODES))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    import torch

    from calm_runtime.cli.common import install_named
    from calm_runtime.data.models import load_model_and_tokenizer
    from calm_runtime.data.sets import load_dataset
    from calm_training.scoring.engine import load_engine
    from calm_training.scoring.local import score_multiple_choice

    torch.set_num_threads(args.threads)
    install_named([model for model, _ in args.pair], [args.data])
    records = load_dataset(args.data)[: args.limit]
    rows = []
    for model_spec, engine_dir in args.pair:
        paths = {"torch": load_model_and_tokenizer(model_spec)[:2],
                 "engine": load_engine(engine_dir, threads=args.threads)[:2]}
        for mode in args.modes:
            def score(path, mode=mode, paths=paths, subset=records):
                model, tokenizer = paths[path]
                start = time.perf_counter()
                scores = score_multiple_choice(model, tokenizer, subset, mode=mode,
                                               batch_size=args.batch_size, progress=False)
                return time.perf_counter() - start, scores

            for path in paths:  # warm-up (first-call allocations, lazy initialisation)
                score(path, subset=records[:2 * args.batch_size])
            seconds = {path: [] for path in paths}
            values = {}
            for r in range(args.rounds):
                for path in (paths if r % 2 == 0 else reversed(list(paths))):
                    elapsed, scores = score(path)
                    seconds[path].append(elapsed)
                    values[path] = scores.values
            diff = float(np.nanmax(np.abs(values["engine"] - values["torch"])))
            qps = {p: len(records) / statistics.median(s) for p, s in seconds.items()}
            ratio = statistics.median(t / e for t, e in zip(seconds["torch"], seconds["engine"],
                                                             strict=True))
            agree = float(np.mean(np.nanargmax(values["engine"], 1)
                                  == np.nanargmax(values["torch"], 1)))
            rows.append({"model": model_spec, "engine": str(engine_dir), "mode": mode,
                         "questions": len(records), "torch_questions_per_s": qps["torch"],
                         "engine_questions_per_s": qps["engine"], "engine_over_torch": ratio,
                         "max_abs_score_diff": diff, "argmax_agreement": agree,
                         "seconds": seconds})
            logger.info("%s %s: torch %.2f q/s, engine %.2f q/s (%.2fx), max |diff| %.2e",
                        model_spec, mode, qps["torch"], qps["engine"], ratio, diff)
    payload = {"command": command_line("scoring.py", argv), "commit": git_commit(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "data": args.data, "limit": args.limit, "threads": args.threads,
               "batch_size": args.batch_size, "rounds": args.rounds,
               "versions": _versions(), "results": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scoring.json").write_text(json.dumps(payload, indent=1) + "\n")
    text = format_markdown(payload)
    (args.out / "scoring.md").write_text(text)
    sys.stdout.write(text)
    return 0


def _versions() -> dict:
    import onnxruntime
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "onnxruntime": onnxruntime.__version__}


def format_markdown(p: dict) -> str:
    v = p["versions"]
    lines = [f"`{p['command']}` at {p['commit']} ({p['date']}); {p['data']}, first "
             f"{p['limit']} questions, batch size {p['batch_size']}, {p['threads']} thread(s), "
             f"{p['rounds']} rounds alternated; torch {v['torch']}, transformers "
             f"{v['transformers']}, onnxruntime {v['onnxruntime']}", "",
             "| model | mode | torch questions/s | engine questions/s | engine / torch | "
             "max abs score diff | same argmax |",
             "|---|---|---|---|---|---|---|"]
    for r in p["results"]:
        lines.append(f"| {r['model']} | {r['mode']} | {r['torch_questions_per_s']:.2f} | "
                     f"{r['engine_questions_per_s']:.2f} | {r['engine_over_torch']:.2f}x | "
                     f"{r['max_abs_score_diff']:.1e} | {r['argmax_agreement']:.3f} |")
    lines += ["", "Scores: cloze = summed log-probability of each option, letter = the option "
              "letters' logits; the engine path is `calm fit`/`calm eval` with the engine "
              "folder as `--model`."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
