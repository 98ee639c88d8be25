"""Calibration benchmark: every post-hoc method side by side, on the real models and data.

    python benchmarks/calibration.py                # full run (scores cached after the first)
    python benchmarks/calibration.py --quick        # first 200 questions of each set
    python benchmarks/calibration.py --render       # rewrite the .md from the committed .json

For each data set, mode and cloze scoring variant it fits vanilla, naive alignment, DACA
(scalar and vector), labeled temperature scaling (scalar and vector) on the calibration
split and evaluates them on the held-out split (accuracy, ECE with a 95% bootstrap
interval, MCE, AECE, Brier, NLL; the bin count is named in every table) and for selective
prediction (AUROC, AURC, PRR with intervals, selective accuracy and coverage at thresholds
0.5-0.95; the per-question confidence and correctness arrays are kept in the JSON). Writes
``results/calibration.json``, ``results/calibration.md`` and, per (data set, mode,
variant), a reliability diagram and a risk-coverage plot (PNG), each naming the command
and the commit that produced it.

Training-time calibration (CALM) has its own benchmark, ``benchmarks/calm_replication.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from _common import command_line, git_commit

from calm_runtime.cli.common import install_named
from calm_runtime.data.prompts import CHOICE_MODES
from calm_training.fit import compare_methods
from calm_training.posthoc.evaluate import write_report
from calm_training.posthoc.fit_config import FitConfig
from calm_training.posthoc.fit_report import format_selective_table, format_table

HERE = Path(__file__).resolve().parent
MC_METHODS = ("vanilla", "naive", "daca", "daca-vector", "ts", "ts-vector")




#: Keys of calibration.json that this script writes; --render drops any other (an older
#: script's section) from the file it rewrites, and says so in the provenance.
KEYS = ("provenance", "results")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--reference", default="gemma-3-270m")
    parser.add_argument("--data", nargs="+", default=["arc-easy", "sciq"])
    parser.add_argument("--modes", nargs="+", default=list(CHOICE_MODES),
                        choices=["cloze", "letter", "p_true"])
    parser.add_argument("--variants", nargs="+", default=["mean", "sum"],
                        choices=["sum", "mean", "char"])
    parser.add_argument("--quick", action="store_true", help="first 200 questions of each set")
    parser.add_argument("--bins", type=int, default=10)
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--note", help="a sentence for the header of calibration.md (kept in "
                        "the JSON's provenance), instead of editing the generated file")
    parser.add_argument("--render", action="store_true",
                        help="no scoring: rewrite OUT/calibration.md from OUT/calibration.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    command = command_line("calibration.py", argv)
    stamp = {"command": command.strip(), "commit": git_commit(),
             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = Path(args.out)
    if args.render:
        return render(out, stamp, args.note)
    install_named([args.model, args.reference], args.data)  # a command line: it may install
    provenance = dict(stamp, **({"note": args.note} if args.note else {}))
    out.mkdir(parents=True, exist_ok=True)
    results = []
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
                print(format_table(report) + "\n", flush=True)
    provenance["wall_s"] = round(time.perf_counter() - start, 1)
    payload = {"provenance": provenance, "results": results}
    (out / "calibration.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / "calibration.md").write_text(markdown(payload))
    return 0


def render(out: Path, stamp: dict, note: str | None) -> int:
    """Rewrite ``calibration.md`` from ``calibration.json`` (and the JSON without keys this
    script does not write), recording the rendering command in the provenance."""
    path = out / "calibration.json"
    payload = json.loads(path.read_text())
    dropped = sorted(set(payload) - set(KEYS))
    provenance = dict(payload["provenance"])
    if note:
        provenance["note"] = note
    provenance["rendered"] = dict(stamp, **({"dropped_keys": dropped} if dropped else {}))
    payload = {"provenance": provenance, "results": payload["results"]}
    path.write_text(json.dumps(payload, indent=1) + "\n")
    (out / "calibration.md").write_text(markdown(payload))
    logging.getLogger(__name__).info("rewrote %s and calibration.md%s", path,
                                     f" (dropped {', '.join(dropped)})" if dropped else "")
    return 0


def markdown(payload: dict) -> str:
    provenance = payload["provenance"]
    header = (f"# Calibration benchmark\n\nProduced by `{provenance['command']}` at commit "
              f"{provenance['commit']} on {provenance['date']} ({provenance['wall_s']} s).\n")
    rendered = provenance.get("rendered")
    if rendered:
        header += (f"Rendered from `calibration.json` by `{rendered['command']}` at commit "
                   f"{rendered['commit']} on {rendered['date']}.\n")
    if provenance.get("note"):
        header += provenance["note"].strip() + "\n"
    header += ("Metrics on the held-out test split; fits on the 30% calibration split "
               "(seed 0). Training-time calibration (CALM): `calm_replication.md`.\n")
    tables = [format_table(report) + ("\n\nselective accuracy (share kept):\n\n"
                                      + format_selective_table(report)
                                      if any("selective" in row for row in
                                             report["methods"].values()) else "")
              for report in payload["results"]]
    return header + "\n" + "\n\n".join(tables) + "\n"


if __name__ == "__main__":
    sys.exit(main())
