"""Calibration benchmark: every post-hoc method side by side, on the real models and data.

    python benchmarks/calibration.py                # full run (scores cached after the first)
    python benchmarks/calibration.py --quick        # first 200 questions of each set

For each data set, mode and cloze scoring variant it fits vanilla, naive alignment, DACA
(scalar and vector), labeled temperature scaling (scalar and vector) on the calibration
split and evaluates them on the held-out split (accuracy, ECE with a 95% bootstrap
interval, MCE, AECE, Brier, NLL; the bin count is named in every table). Writes
``results/calibration.json``, ``results/calibration.md`` and one reliability-diagram PNG
per (data set, mode, variant), each naming the command and the commit that produced it.

Training-time calibration (CALM) has its own benchmark, ``benchmarks/calm_replication.py``.
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
    provenance["wall_s"] = round(time.perf_counter() - start, 1)
    (out / "calibration.json").write_text(json.dumps({"provenance": provenance,
                                                      "results": results}, indent=1) + "\n")
    header = (f"# Calibration benchmark\n\nProduced by `{provenance['command']}` at commit "
              f"{provenance['commit']} on {provenance['date']} ({provenance['wall_s']} s).\n"
              "Metrics on the held-out test split; fits on the 30% calibration split "
              "(seed 0).\n")
    (out / "calibration.md").write_text(header + "\n" + "\n\n".join(tables) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
