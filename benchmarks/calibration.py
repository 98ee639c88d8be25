"""Calibration benchmark: every post-hoc method side by side, on the real models and data.

    python benchmarks/calibration.py                # full run (scores cached after the first)
    python benchmarks/calibration.py --quick        # first 200 questions of each set

For each data set, mode and cloze scoring variant it fits vanilla, naive alignment, DACA
(scalar and vector), labeled temperature scaling (scalar and vector) on the calibration
split and evaluates them on the held-out split (accuracy, ECE with a 95% bootstrap
interval, MCE, AECE, Brier, NLL; the bin count is named in every table). Writes
``results/calibration.json``, ``results/calibration.md`` and one reliability-diagram PNG
per (data set, mode, variant), each naming the command and the commit that produced it.

Training-time methods: when the adapters of ``benchmarks/calm_real_run.py`` exist
(``--calm-adapters``, default ``calm-out/calm-real/adapters``; train them with that script),
the same run adds its evaluation — CALM, plain LoRA, the ablations and CALM + DACA against
vanilla, DACA and labeled TS fitted in-domain (ARC-Easy + SciQ) and carried over to MMLU and
ARC-Challenge (out-of-domain), cloze mode, mean scores. Without them the section says so.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from _common import git_commit

from calm_training.evaluate import write_report
from calm_training.fit import FitConfig, compare_methods, format_table

HERE = Path(__file__).resolve().parent
MC_METHODS = ("vanilla", "naive", "daca", "daca-vector", "ts", "ts-vector")




def _calm_section(args) -> dict | None:
    """CALM and its baselines in- and out-of-domain, from calm_real_run's adapters."""
    import calm_real_run

    present = [m for m in calm_real_run.TRAINED
               if (Path(args.calm_adapters) / calm_real_run.KIND[m]).is_dir()]
    if not present:
        logging.getLogger("calibration").warning(
            "no CALM adapters under %s: the training-time rows are left out (train them with "
            "python benchmarks/calm_real_run.py)", args.calm_adapters)
        return None
    real = calm_real_run.parse_args([
        "--model", args.model, "--reference", args.reference, "--adapters", args.calm_adapters,
        "--bins", str(args.bins), "--methods", *present,
        "--eval-limit", str(20 if args.quick else args.calm_eval_limit)])
    runs = calm_real_run.train_all(real)  # reuses the adapters, trains nothing
    report = calm_real_run.evaluate(real, runs)
    markdown = "\n\n".join(calm_real_run.format_set(n, e, args.bins)
                            for n, e in report.items())
    return {"adapters": args.calm_adapters, "eval_limit": real.eval_limit,
            "evaluation": report, "markdown": "## Training-time calibration (CALM)\n\n" +
            markdown}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--reference", default="gemma-3-270m")
    parser.add_argument("--data", nargs="+", default=["arc-easy", "sciq"])
    parser.add_argument("--modes", nargs="+", default=["cloze", "letter"],
                        choices=["cloze", "letter", "p_true"])
    parser.add_argument("--variants", nargs="+", default=["mean", "sum"],
                        choices=["sum", "mean", "char"])
    parser.add_argument("--quick", action="store_true", help="first 200 questions of each set")
    parser.add_argument("--bins", type=int, default=10)
    parser.add_argument("--calm-adapters", default="calm-out/calm-real/adapters",
                        help="adapters trained by benchmarks/calm_real_run.py")
    parser.add_argument("--calm-eval-limit", type=int, default=200,
                        help="questions per part in the CALM section (--quick: 20)")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    command = "python benchmarks/calibration.py " + " ".join(argv if argv is not None
                                                             else sys.argv[1:])
    provenance = {"command": command.strip(), "commit": git_commit(),
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, tables = [], []
    start = time.perf_counter()
    for data in args.data:
        for mode in args.modes:
            variants = args.variants if mode == "cloze" else ["sum"]
            for variant in variants:
                config = FitConfig(model=args.model, reference=args.reference, data=data,
                                   mode=mode, variant=variant, n_bins=args.bins,
                                   limit=200 if args.quick else None)
                methods = MC_METHODS if mode != "p_true" else ("vanilla", "naive", "daca", "ts")
                report = compare_methods(config, methods)
                stem = f"calibration-{data}-{mode}" + (f"-{variant}" if mode == "cloze" else "")
                write_report(report, out, stem)
                report.pop("_panels", None)
                results.append(report)
                tables.append(format_table(report))
                print(tables[-1] + "\n", flush=True)
    calm_section = _calm_section(args)
    if calm_section is not None:
        tables.append(calm_section["markdown"])
        print(tables[-1] + "\n", flush=True)
    provenance["wall_s"] = round(time.perf_counter() - start, 1)
    (out / "calibration.json").write_text(json.dumps({"provenance": provenance,
                                                      "results": results,
                                                      "calm": calm_section}, indent=1) + "\n")
    header = (f"# Calibration benchmark\n\nProduced by `{provenance['command']}` at commit "
              f"{provenance['commit']} on {provenance['date']} ({provenance['wall_s']} s).\n"
              "Metrics on the held-out test split; fits on the 30% calibration split "
              "(seed 0).\n")
    (out / "calibration.md").write_text(header + "\n" + "\n\n".join(tables) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
