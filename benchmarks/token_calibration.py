"""Token-level calibration: what a cloze fit puts into the engine's head, measured.

    python benchmarks/token_calibration.py --lora gemma-lora-60=ADAPTER
    python benchmarks/token_calibration.py --render    # rewrite the .md from the .json

A cloze fit calibrates option probabilities with ``answer_temperature``; the token
log-probabilities an engine serves are calibrated only by a token-level temperature
(docs/methods.md §3, "Token level"), which ``calm fit`` fits where a signal exists. This
benchmark runs that fit (``calm_training.posthoc.token_fit.cloze_token_temperature``, the function
``calm fit`` calls) for three pairs on ARC-Easy and measures token-level ECE before and after
on the held-out test part: at every answer token of the correct answer (teacher-forced after
``Question: ...\\nAnswer:``), confidence = the top next-token probability, correct = that
token is the answer's next token (10 bins). Intervals resample the unit that was sampled:
the positions of one question are not independent, so the ECE intervals draw whole test
questions (with all their positions), and each fitted temperature gets an interval by
refitting it on fit questions drawn with replacement (``_common.temperature_interval``).
The counts say what entered each fit: fit questions, the questions with answer positions
(DACA: those where both models choose the same option), the positions, and the positions
used (DACA: where the two models' next-token argmax agrees; ``n_used``).

* ``--lora NAME=ADAPTER``: a same-tokenizer pair, Gemma-3-270M fine-tuned with a calm LoRA
  against Gemma-3-270M base (the README's ``gemma-lora-60``: ``calm train --method lora
  --model gemma-3-270m --mode cloze --train arc-easy:train --train sciq:train --calibration
  arc-easy:unlabeled --steps 60 --outer-lr 1e-3 --out ADAPTER``, as in
  benchmarks/daca_regime.py, which records its training time):
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
from _common import cluster_bootstrap_interval, command_line, git_commit, temperature_interval

from calm_runtime.cli.common import install_named
from calm_runtime.data.models import load_model_and_tokenizer
from calm_runtime.data.sets import load_dataset, split_records
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_runtime.measure import metrics
from calm_training.methods import fit_method
from calm_training.methods.calm import TRAIN_SPLIT_FRACTION, TRAIN_SPLIT_SEED, UNLABELED_PART
from calm_training.posthoc.fit_config import DEFAULT_VARIANT
from calm_training.posthoc.token_fit import (
    answer_positions,
    cloze_token_temperature,
    token_confidences,
)
from calm_training.scoring.cache import cached_option_scores

#: how the committed intervals resample (a file without this key resampled positions)
INTERVAL_UNIT = "questions"

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
              "seconds": round(time.time() - started, 1), "n_bins": 10,
              "interval_unit": INTERVAL_UNIT, "bootstrap": args.bootstrap, "rows": rows}
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
        fit_method(method), model=model, reference=reference, records=fit_records, chosen=chosen,
        agree=agree, labels=mine.labels, base_adapter=base, progress=True)
    row = {"pair": name, "model": model, "adapter": adapter_dir, "reference": reference,
           "method": method, "fit_data": fit_part, "test_data": test_part,
           "option_accuracy_fit": float((chosen == mine.labels).mean()),
           "fit_questions": len(fit_records), "token_fit": record}
    if fit is None:
        return row
    lm, tokenizer, _ = load_model_and_tokenizer(model, lora_path=base.lora_path if base else None)
    calibration = base if base is not None and base.has_token_calibration() else None
    # the fit's own rows again (the fit returns only its result), to refit T on resampled
    # fit questions
    logits, scores, owner = _fit_rows(method, lm, tokenizer, reference, fit_records, chosen,
                                      agree, mine.labels, calibration)
    row["fit_positions_used"] = int(len(scores))
    row["temperature_interval"] = fit_interval(logits, scores, owner, fit, len(fit_records),
                                               bootstrap)
    del logits
    test_records = load_dataset(test_part)
    labels = np.array([r.answer for r in test_records])
    pos = answer_positions(lm, tokenizer, test_records, labels, progress=True, max_bytes=None)
    row["test_positions"] = int(len(pos.targets))
    row["test_questions"] = len(test_records)
    for key, temperature in (("before", 1.0), ("after", fit.temperature)):
        conf, correct, nll = token_confidences(pos.logits, pos.targets, temperature)
        row[key] = {"temperature": temperature, "ece": float(metrics.ece(conf, correct, 10)),
                    "ece_ci95": list(cluster_bootstrap_interval(
                        lambda c, y: metrics.ece(c, y, 10), pos.question, conf, correct,
                        n_clusters=len(test_records), n_resamples=bootstrap)),
                    "accuracy": float(correct.mean()), "mean_confidence": float(conf.mean()),
                    "nll": float(nll.mean())}
    return row


def fit_interval(logits, scores, owner, fit, n_questions: int, bootstrap: int) -> dict:
    """The temperature's bootstrap interval over the fit questions, or why there is none (a
    fit at a bound, T infinite or capped, has no interior optimum to resample)."""
    if fit.at_bound is not None or not np.isfinite(fit.temperature):
        return {"skipped": f"the fit is at a bound ({fit.at_bound})"}
    out = temperature_interval(logits, scores, owner, temperature=fit.temperature,
                               n_clusters=n_questions, n_resamples=bootstrap)
    if abs(out["refit"] - fit.temperature) > 1e-3 * fit.temperature:
        logger.warning("the interval's rows refit T = %.4f, the fit gave %.4f", out["refit"],
                       fit.temperature)
    return out


def _fit_rows(method, lm, tokenizer, reference, records, chosen, agree, labels, calibration):
    """The rows the token-level fit minimises over, as ``token_level_fit`` builds them:
    ``(logits [P, V], target scores [P], the fit question of each row [P])``. Labeled: every
    answer position of the correct answers, scored by the target's logit. DACA: the answer
    positions of the questions where both models choose the same option, kept where the
    next-token argmax agrees, scored by ``p_ref . z``."""
    if method == "ts":
        pos = answer_positions(lm, tokenizer, records, labels, calibration=calibration,
                               progress=True)
        return pos.logits, pos.logits[np.arange(len(pos.targets)), pos.targets], pos.question
    ref, ref_tokenizer, _ = load_model_and_tokenizer(reference)
    keep = np.flatnonzero(agree)
    subset = [records[i] for i in keep]
    options = np.asarray(chosen)[keep]
    mine = answer_positions(lm, tokenizer, subset, options, calibration=calibration,
                            progress=True)
    n = mine.n_questions  # within the memory budget, as token_level_fit reads them
    theirs = answer_positions(ref, ref_tokenizer, subset[:n], options[:n], progress=True,
                              max_bytes=None)
    del ref
    width = min(mine.logits.shape[1], theirs.logits.shape[1])
    z, r = mine.logits[:, :width], theirs.logits[:, :width]
    used = r.argmax(axis=1) == z.argmax(axis=1)
    scores = np.empty(int(used.sum()))
    for n, i in enumerate(np.flatnonzero(used)):
        p = np.exp(r[i].astype(np.float64) - r[i].max())
        scores[n] = float((p / p.sum()) @ z[i].astype(np.float64))
    return z[used], scores, keep[mine.question[used]]


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
    unit = result.get("interval_unit", "positions")
    lines = ["# Token-level calibration on ARC-Easy", "",
             f"Generated by `{result['command']}` at commit {result['commit']} on "
             f"{result['created']} ({result['seconds']:.0f} s); do not edit by hand.", "",
             "Token-level ECE: at each answer token of the held-out questions' correct answer, "
             "confidence = the top next-token probability, correct = that token is the next "
             f"one ({result['n_bins']} bins, 95% bootstrap intervals).", ""]
    if unit == "questions":
        lines += ["ECE intervals resample test questions (all positions of a drawn question "
                  "together); T's interval refits T on fit questions drawn with replacement. "
                  "fit counts: fit questions → questions with answer positions → positions → "
                  "positions used by the fit.", ""]
    else:
        lines += [f"Stale: the ECE intervals of this file resample {unit}, which cluster "
                  "within questions, so they are too narrow, and T has no interval; the "
                  "script now resamples questions and intervals T over fit questions (rerun "
                  "it to replace this file). fit counts: fit questions → questions with "
                  "answer positions → positions → positions used by the fit.", ""]
    lines += ["| pair | token fit | fitted on | fit counts | T [95% CI] | test questions / "
              "positions | token acc | ECE before | ECE after | mean conf before → after | "
              "NLL before → after |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        record = row["token_fit"]
        if not record.get("fitted"):
            lines.append(f"| {row['pair']} | {row['method']}: none ({record['reason']}) | "
                         f"{row['fit_data']} | - | - | - | - | - | - | - | - |")
            continue
        b, a = row["before"], row["after"]
        lines.append(
            f"| {row['pair']} | {record['method']} | {row['fit_data']} | {fit_counts(row)} | "
            f"{temperature_cell(row)} | {row['test_questions']} / {row['test_positions']} | "
            f"{b['accuracy']:.3f} | {_ece(b)} | {_ece(a)} | "
            f"{b['mean_confidence']:.3f} → {a['mean_confidence']:.3f} | "
            f"{b['nll']:.3f} → {a['nll']:.3f} |")
    return "\n".join(lines) + "\n"


def fit_counts(row: dict) -> str:
    """``fit questions → questions with positions → positions → positions used``; from a
    file written before ``fit_questions`` was recorded, the fit questions are the fit's ``n``
    (label-free: ``n_questions``) or its question count (labeled)."""
    record = row["token_fit"]
    total = row.get("fit_questions")
    if total is None:
        total = record["questions"] if record["method"].startswith("ts") else record["n"]
    return (f"{total} → {record['questions']} → {record['positions']} → "
            f"{record['n_used']}")


def temperature_cell(row: dict) -> str:
    temperature = row["after"]["temperature"]
    interval = row.get("temperature_interval")
    if not interval:
        return f"{temperature:.3f} (no interval)"
    if "skipped" in interval:
        return f"{temperature:.3f} ({interval['skipped']})"
    low, high = interval["ci95"]
    return f"{temperature:.3f} [{low:.3f}, {high:.3f}]"


def _ece(m: dict) -> str:
    low, high = m["ece_ci95"]
    return f"{m['ece']:.3f} [{low:.3f}, {high:.3f}]"


if __name__ == "__main__":
    sys.exit(main())
