"""Token-level calibration: what a cloze fit puts into the engine's head, measured.

    python benchmarks/token_calibration.py --lora gemma-lora-60=ADAPTER
    python benchmarks/token_calibration.py --render    # rewrite the .md from the .json

A cloze fit calibrates option probabilities with ``answer_temperature``; the token
log-probabilities an engine serves are calibrated only by a token-level temperature
(docs/methods.md §3, "Token level"), which ``calm fit`` fits where a signal exists. This
benchmark runs that fit (``calm_training.token_fit.cloze_token_temperature``, the function
``calm fit`` calls) for three pairs on ARC-Easy and measures token-level ECE before and after
on the held-out test part: at every answer token of the correct answer (teacher-forced after
``Question: ...\\nAnswer:``), confidence = the top next-token probability, correct = that
token is the answer's next token (10 bins, 95% bootstrap interval over positions).

* ``--lora NAME=ADAPTER``: a same-tokenizer pair, Gemma-3-270M fine-tuned with a calm LoRA
  against Gemma-3-270M base (the README's ``gemma-lora-60``: ``calm train --method lora
  --model gemma-3-270m --mode cloze --train arc-easy:train --train sciq:train --calibration
  arc-easy:unlabeled --steps 60 --outer-lr 1e-3 --out ADAPTER``, as in
  benchmarks/daca_regime.py; 656 s on 2 cores):
  label-free token DACA, and labeled token TS beside it. Fitted on ``arc-easy:unlabeled``
  (the half of the calibration part the LoRA did not train on).
* SmolLM2-135M-Instruct with labels: token TS, fitted on ``arc-easy:calibration``.
* The README's pair (SmolLM2 against Gemma-3-270M, label-free): different tokenizers, so no
  token-level fit; recorded with its reason.

Writes ``results/token_calibration.{json,md}``, naming the command and the commit.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
from _common import command_line, git_commit

from calm_runtime import metrics
from calm_runtime.artifact import CalibrationAdapter
from calm_runtime.cli import install_named
from calm_runtime.data import load_dataset, split_records
from calm_runtime.models import load_model_and_tokenizer
from calm_training.cache import cached_option_scores
from calm_training.calm_data import TRAIN_SPLIT_FRACTION, TRAIN_SPLIT_SEED, UNLABELED_PART
from calm_training.fit import DEFAULT_VARIANT
from calm_training.token_fit import answer_positions, cloze_token_temperature, token_confidences

HERE = Path(__file__).resolve().parent
STEM = "token_calibration"
logger = logging.getLogger("token_calibration")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=ADAPTER",
                        help="a calm LoRA adapter on --lora-base, calibrated against the base")
    parser.add_argument("--lora-base", default="gemma-3-270m")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--reference", default="gemma-3-270m")
    parser.add_argument("--data", default="arc-easy")
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--render", action="store_true", help="only rewrite the .md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = HERE / "results"
    if args.render:
        (out / f"{STEM}.md").write_text(render(json.loads((out / f"{STEM}.json").read_text())))
        return 0
    install_named([args.model, args.reference, args.lora_base], [args.data])
    started = time.time()
    rows = []
    for spec in args.lora:
        name, adapter = spec.split("=", 1)
        for method in ("daca", "ts"):
            rows.append(run_arm(f"{name} vs {args.lora_base}", args.lora_base, adapter,
                                args.lora_base, method, f"{args.data}:unlabeled",
                                f"{args.data}:test", args.bootstrap))
    rows.append(run_arm(args.model, args.model, None, None, "ts", f"{args.data}:calibration",
                        f"{args.data}:test", args.bootstrap))
    rows.append(run_arm(f"{args.model} vs {args.reference}", args.model, None, args.reference,
                        "daca", f"{args.data}:calibration", f"{args.data}:test",
                        args.bootstrap))
    result = {"command": command_line("token_calibration.py", argv), "commit": git_commit(),
              "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "seconds": round(time.time() - started, 1), "n_bins": 10, "rows": rows}
    (out / f"{STEM}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{STEM}.md").write_text(render(result))
    print(render(result))
    return 0


def run_arm(name, model, adapter_dir, reference, method, fit_part, test_part, bootstrap):
    logger.info("%s: token-level %s, fit on %s", name, method, fit_part)
    fit_records = _records(fit_part)
    base = CalibrationAdapter.from_pretrained(adapter_dir) if adapter_dir else None
    mine = cached_option_scores(model, fit_records, mode="cloze", adapter_dir=adapter_dir)
    chosen = mine.scores(DEFAULT_VARIANT).argmax(1)
    agree = None
    if reference is not None and method != "ts":
        theirs = cached_option_scores(reference, fit_records, mode="cloze")
        agree = theirs.scores(DEFAULT_VARIANT).argmax(1) == chosen
    fit, record = cloze_token_temperature(
        method, model=model, reference=reference, records=fit_records, chosen=chosen,
        agree=agree, labels=mine.labels, base_adapter=base, progress=True)
    row = {"pair": name, "model": model, "adapter": adapter_dir, "reference": reference,
           "method": method, "fit_data": fit_part, "test_data": test_part,
           "option_accuracy_fit": float((chosen == mine.labels).mean()),
           "token_fit": record}
    if fit is None:
        return row
    test_records = load_dataset(test_part)
    lm, tokenizer, _ = load_model_and_tokenizer(model, lora_path=base.lora_path if base else None)
    labels = np.array([r.answer for r in test_records])
    pos = answer_positions(lm, tokenizer, test_records, labels, progress=True)
    row["test_positions"] = int(len(pos.targets))
    row["test_questions"] = len(test_records)
    for key, temperature in (("before", 1.0), ("after", fit.temperature)):
        conf, correct, nll = token_confidences(pos.logits, pos.targets, temperature)
        row[key] = {"temperature": temperature, "ece": float(metrics.ece(conf, correct, 10)),
                    "ece_ci95": list(metrics.bootstrap_interval(
                        lambda c, y: metrics.ece(c, y, 10), conf, correct,
                        n_resamples=bootstrap)),
                    "accuracy": float(correct.mean()), "mean_confidence": float(conf.mean()),
                    "nll": float(nll.mean())}
    return row


def _records(part: str):
    """``NAME:unlabeled`` with its labels kept (for the labeled arm; the label-free one never
    reads them), any other part as calm loads it."""
    head, _, tail = part.rpartition(":")
    if tail != UNLABELED_PART:
        return load_dataset(part)
    _, unlabeled = split_records(load_dataset(f"{head}:calibration"), TRAIN_SPLIT_FRACTION,
                                 TRAIN_SPLIT_SEED)
    return unlabeled


def render(result: dict) -> str:
    lines = ["# Token-level calibration on ARC-Easy", "",
             f"Generated by `{result['command']}` at commit {result['commit']} on "
             f"{result['created']} ({result['seconds']:.0f} s); do not edit by hand.", "",
             "Token-level ECE: at each answer token of the held-out questions' correct answer, "
             "confidence = the top next-token probability, correct = that token is the next "
             f"one ({result['n_bins']} bins, 95% bootstrap interval over positions).", "",
             "| pair | token fit | fitted on | T | test positions | token acc | ECE before | "
             "ECE after | mean conf before → after | NLL before → after |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        record = row["token_fit"]
        if not record.get("fitted"):
            lines.append(f"| {row['pair']} | {row['method']}: none ({record['reason']}) | "
                         f"{row['fit_data']} | - | - | - | - | - | - | - |")
            continue
        b, a = row["before"], row["after"]
        lines.append(
            f"| {row['pair']} | {record['method']} ({record['positions']} positions of "
            f"{record['questions']} questions) | {row['fit_data']} | {a['temperature']:.3f} | "
            f"{row['test_positions']} | {b['accuracy']:.3f} | {_ece(b)} | {_ece(a)} | "
            f"{b['mean_confidence']:.3f} → {a['mean_confidence']:.3f} | "
            f"{b['nll']:.3f} → {a['nll']:.3f} |")
    return "\n".join(lines) + "\n"


def _ece(m: dict) -> str:
    low, high = m["ece_ci95"]
    return f"{m['ece']:.3f} [{low:.3f}, {high:.3f}]"


if __name__ == "__main__":
    sys.exit(main())
