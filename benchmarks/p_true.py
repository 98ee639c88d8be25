"""P(True) on real open QA: does calibration make "is my answer right?" trustworthy?

    python benchmarks/p_true.py                 # 1,000 TriviaQA questions, both templates
    python benchmarks/p_true.py --limit 200     # quicker, noisier

SmolLM2-135M-Instruct answers each question greedily ("Question: ...\\nAnswer:", cut at the
first newline); an answer is correct when it matches one of the question's aliases (SQuAD
normalisation). The model then judges its own answer with a P(True) template (both
templates, ``kadavath`` and ``yes-no``), and the two-way True/False distribution is
calibrated by temperature scaling (labeled), Platt scaling (labeled: a temperature and a
shift), naive alignment and DACA (label-free, Gemma-3-270M base judging the same answers)
on the 30% calibration split. Metrics on the held-out 70%: ECE with a 95% bootstrap
interval, AUROC, AURC, selective accuracy. Writes ``results/p_true.{json,md}`` and, per
template, ``results/p_true-TEMPLATE.{json,png}`` and the risk-coverage plot, each naming
the command and the commit.
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
from calm_training.fit import compare_methods
from calm_training.methods import P_TRUE_METHODS
from calm_training.posthoc.evaluate import write_report
from calm_training.posthoc.fit_config import FitConfig
from calm_training.posthoc.fit_report import format_selective_table, format_table

HERE = Path(__file__).resolve().parent
TEMPLATES = ("kadavath", "yes-no")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--reference", default="gemma-3-270m")
    parser.add_argument("--data", default="triviaqa")
    parser.add_argument("--limit", type=int, default=1000, help="questions (default 1000)")
    parser.add_argument("--templates", nargs="+", default=list(TEMPLATES), choices=TEMPLATES)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    install_named([args.model, args.reference], [args.data])  # a command line: it may install
    command = command_line("p_true.py", argv)
    provenance = {"command": command.strip(), "commit": git_commit(),
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, sections = {}, []
    start = time.perf_counter()
    for template in args.templates:
        config = FitConfig(model=args.model, reference=args.reference, data=args.data,
                           mode="p_true", p_true_template=template, limit=args.limit,
                           batch_size=args.batch_size)
        began = time.perf_counter()
        report = compare_methods(config, P_TRUE_METHODS)
        report["wall_s"] = round(time.perf_counter() - began, 1)
        write_report(report, out, f"p_true-{template}")
        report.pop("_panels", None)
        results[template] = report
        sections.append(f"### template `{template}` ({report['wall_s']} s)\n\n"
                        + format_table(report) + "\n\nselective accuracy (share kept):\n\n"
                        + format_selective_table(report))
        print(sections[-1] + "\n", flush=True)
    provenance["wall_s"] = round(time.perf_counter() - start, 1)
    payload = {"provenance": provenance,
               "results": results}
    (out / "p_true.json").write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
    header = (f"# P(True) on open QA\n\nProduced by `{provenance['command']}` at commit "
              f"{provenance['commit']} on {provenance['date']} ({provenance['wall_s']} s, "
              "answers and judgements cached after the first run). The model answers "
              "greedily and judges its own answer; correctness by alias match; fits on the "
              "30% calibration split, metrics on the held-out 70% (10 bins, ECE with a 95% "
              "bootstrap interval). Per template: `p_true-TEMPLATE.json` (with every "
              "question's confidence and correctness), `.png` (reliability diagrams) and "
              "`-risk-coverage.png`.\n")
    (out / "p_true.md").write_text(header + "\n" + "\n\n".join(sections) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
