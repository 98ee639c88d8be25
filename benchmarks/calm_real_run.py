"""CALM on a real model: train CALM, plain LoRA and the ablations, then evaluate them all.

    python benchmarks/calm_real_run.py                # full run
    python benchmarks/calm_real_run.py --eval-limit 300   # same training, smaller evaluation
    python benchmarks/calm_real_run.py --smoke        # 2 steps each, 24+24 questions per set

Cost on the 2-core CPU: a CALM step (batch 8 + 8, T_inner 2, entropy at the answer
position) takes about 5 s alone (up to 9 s with other jobs running), so the default 100
steps train in 9-15 min; plain LoRA and the ablations cost less per step. The evaluation
scores every (scorer, data set) pair in cloze mode; ``--eval-limit`` bounds the questions
per part. The trained adapters score the test parts only (CALM also its calibration parts,
for DACA on top). Scores are cached, so a rerun only scores what is new.

Model: SmolLM2-135M-Instruct (``smollm2-135m-instruct``). Training data (labeled):
``arc-easy:train`` + ``sciq:train``; calibration data (unlabeled): ``arc-easy:unlabeled`` +
``sciq:unlabeled`` — both halves of each set's 30% calibration part
(:mod:`calm_training.calm_data`), so the 70% test parts stay unseen.

Evaluation, cloze mode, per-token mean option scores (the lead's default), questions with
four options, on the test part of ARC-Easy and SciQ (in-domain) and of MMLU and
ARC-Challenge (out-of-domain):

* ``vanilla`` — the model as is;
* ``ts-in-domain`` — labeled temperature scaling fitted on the vanilla scores of the
  ARC-Easy + SciQ calibration parts (the data CALM trains on), applied everywhere;
* ``daca`` — label-free DACA (reference ``gemma-3-270m``) fitted on each set's own
  calibration part;
* ``lora`` — plain LoRA fine-tuning with the same data, steps and settings (no α);
* ``calm`` — bilevel CALM; ``calm+daca`` — DACA fitted on top of CALM (composition);
* ``calm_regularization``, ``calm_iterate``, ``calm_scalar`` — the ablations.

Writes ``OUT/calm_real_run.json`` and ``OUT/calm_real_run.md`` (default
``benchmarks/results``), naming the command and commit; adapters go to ``--adapters``.
Trained adapters are reused when present (``--retrain`` to train again); an interrupted
training resumes from its checkpoints with ``--resume``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
from _common import git_commit

from calm_runtime import metrics
from calm_runtime.artifact import CalibrationAdapter
from calm_runtime.data import load_dataset, split_indices
from calm_runtime.errors import FitError
from calm_training import daca
from calm_training.cache import cached_option_scores
from calm_training.fit import option_probabilities
from calm_training.trainer import CalmConfig, latest_checkpoint, train_calm

HERE = Path(__file__).resolve().parent
IN_DOMAIN = ("arc-easy", "sciq")
OUT_OF_DOMAIN = ("mmlu", "arc-challenge")
TRAINED = ("bilevel", "lora", "regularization", "iterate", "scalar")
KIND = {"bilevel": "calm", "lora": "lora", "regularization": "calm_regularization",
        "iterate": "calm_iterate", "scalar": "calm_scalar"}
K = 4  # options per question evaluated (the questions with another count are left out)
logger = logging.getLogger("calm_real_run")




def _config(args, method: str) -> CalmConfig:
    return CalmConfig(
        model=args.model, train=tuple(f"{d}:train" for d in IN_DOMAIN),
        calibration=tuple(f"{d}:unlabeled" for d in IN_DOMAIN), method=method,
        steps=args.steps, batch_size=args.batch_size,
        calibration_batch_size=args.calibration_batch_size, inner_steps=args.inner_steps,
        inner_lr=args.inner_lr, outer_lr=args.outer_lr, alpha_lr=args.alpha_lr,
        calibration_positions=args.calibration_positions, lora_rank=8, lora_alpha=16.0,
        max_length=256, seed=args.seed, checkpoint_every=args.checkpoint_every)


def train_all(args) -> dict:
    """Train each method (or reuse its adapter); returns per-method directory and summary."""
    runs = {}
    for method in args.methods:
        out = Path(args.adapters) / KIND[method]
        if out.is_dir() and not args.retrain:
            adapter = CalibrationAdapter.from_pretrained(out)
            logger.info("reusing %s (%s)", out, adapter.kind)
            training = adapter.metrics.get("training", {})
        else:
            checkpoints = out.with_name(out.name + ".checkpoints")
            resume = args.resume and latest_checkpoint(checkpoints) is not None
            result = train_calm(_config(args, method), out, overwrite=True, resume=resume)
            training = result.adapter.metrics["training"]
        runs[method] = {"dir": str(out), "seconds": training.get("seconds"),
                        "steps": training.get("steps"), "first": training.get("first"),
                        "last": training.get("last")}
        logger.info("%s: %s steps in %s s", method, runs[method]["steps"],
                    runs[method]["seconds"])
    return runs


def _split(name: str, limit: int | None):
    """``(records, cal_rows, test_rows)``: the 30/70 split of the whole set (so a limit never
    moves training records into the test rows), each part cut to ``limit``."""
    records = load_dataset(name)
    cal, test = split_indices(len(records), 0.3, 0)
    cal, test = (cal[:limit], test[:limit]) if limit else (cal, test)
    keep = [i for i in (*cal, *test) if len(records[i].choices) == K]
    subset = [records[i] for i in keep]
    cal_set = set(cal.tolist())
    is_cal = np.array([i in cal_set for i in keep])
    return subset, np.flatnonzero(is_cal), np.flatnonzero(~is_cal)


def _scores(args, records, adapter_dir=None, model=None) -> np.ndarray:
    scores = cached_option_scores(model or args.model, records, mode="cloze",
                                  adapter_dir=adapter_dir, batch_size=args.eval_batch_size,
                                  progress=not args.quiet)
    return scores.scores("mean")[:, :K], scores.labels


def _row(probs, labels, n_bins: int, temperature=None) -> dict:
    row = metrics.calibration_report(probs, labels, n_bins)
    row["temperature"] = temperature
    return row


def _daca(plm, polm, cal):
    try:
        fit = daca.fit_daca_temperature(plm[cal], polm[cal], mask=True)
    except FitError as exc:
        logger.warning("DACA fit failed: %s", exc)
        return None
    return fit.temperature if np.isfinite(fit.temperature) else None


def evaluate(args, runs: dict) -> dict:
    splits = {name: _split(name, args.eval_limit) for name in (*IN_DOMAIN, *OUT_OF_DOMAIN)}
    # labeled TS on the in-domain calibration parts (vanilla scores), applied everywhere
    pooled, pooled_labels = [], []
    for name in IN_DOMAIN:
        records, cal, _ = splits[name]
        s, y = _scores(args, records)
        pooled.append(s[cal])
        pooled_labels.append(y[cal])
    ts = daca.fit_temperature_scaling(np.concatenate(pooled), np.concatenate(pooled_labels))
    report = {}
    for name, (records, cal, test) in splits.items():
        vanilla, labels = _scores(args, records)
        y = labels[test]
        rows = {"vanilla": _row(option_probabilities(vanilla[test]), y, args.bins),
                "ts-in-domain": _row(option_probabilities(vanilla[test], ts.temperature), y,
                                     args.bins, ts.temperature)}
        plm = None
        if not args.no_daca:
            plm, _ = _scores(args, records, model=args.reference)
            t = _daca(plm, vanilla, cal)
            if t is not None:
                rows["daca"] = _row(option_probabilities(vanilla[test], t), y, args.bins, t)
        for method, run in runs.items():
            if method == "bilevel" and plm is not None:  # DACA on top needs the calibration part
                tuned, _ = _scores(args, records, adapter_dir=run["dir"])
                t = _daca(plm, tuned, cal)
                if t is not None:
                    rows["calm+daca"] = _row(option_probabilities(tuned[test], t), y,
                                             args.bins, t)
                tuned = tuned[test]
            else:  # the test part only
                tuned, _ = _scores(args, [records[i] for i in test], adapter_dir=run["dir"])
            rows[KIND[method]] = _row(option_probabilities(tuned), y, args.bins)
        report[name] = {"domain": "in" if name in IN_DOMAIN else "out", "n_test": int(test.size),
                        "n_calibration": int(cal.size), "methods": rows}
        print(format_set(name, report[name], args.bins) + "\n", flush=True)
    return report


def format_set(name: str, entry: dict, n_bins: int) -> str:
    lines = [f"{name} ({entry['domain']}-domain), cloze mean scores, test n={entry['n_test']}, "
             f"{n_bins} bins", "", "| method | T | acc | ECE | AECE | Brier | NLL |",
             "|---|---|---|---|---|---|---|"]
    for method, row in entry["methods"].items():
        t = "" if row.get("temperature") is None else f"{row['temperature']:.3f}"
        lines.append(f"| {method} | {t} | {row['accuracy']:.3f} | {row['ece']:.3f} | "
                     f"{row['aece']:.3f} | {row['brier']:.3f} | {row['nll']:.3f} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--reference", default="gemma-3-270m", help="DACA's reference model")
    parser.add_argument("--methods", nargs="+", default=list(TRAINED), choices=TRAINED)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--calibration-batch-size", type=int, default=8)
    parser.add_argument("--calibration-positions", default="answer",
                        choices=["answer", "options"])
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--inner-lr", type=float, default=0.01)
    parser.add_argument("--outer-lr", type=float, default=1e-3)
    parser.add_argument("--alpha-lr", type=float, default=5e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--eval-limit", type=int, help="first N calibration and N test "
                        "questions of each evaluation set")
    parser.add_argument("--eval-batch-size", type=int, default=8)
    parser.add_argument("--bins", type=int, default=10)
    parser.add_argument("--no-daca", action="store_true", help="skip the DACA rows")
    parser.add_argument("--smoke", action="store_true",
                        help="2 steps per method, 24 questions per part (shows it works)")
    parser.add_argument("--retrain", action="store_true", help="train even if adapters exist")
    parser.add_argument("--resume", action="store_true", help="resume from checkpoints")
    parser.add_argument("--adapters", default="calm-out/calm-real/adapters")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.eval_limit, args.checkpoint_every = 2, args.eval_limit or 24, 0
        args.adapters = args.adapters.replace("calm-real", "calm-real-smoke")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command = "python benchmarks/calm_real_run.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    started = time.perf_counter()
    runs = train_all(args)
    trained_s = time.perf_counter() - started
    report = evaluate(args, runs)
    payload = {"provenance": {"command": command.strip(), "commit": git_commit(),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "train_wall_s": round(trained_s, 1),
                              "total_wall_s": round(time.perf_counter() - started, 1),
                              "settings": vars(args)},
               "training": runs, "evaluation": report}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "calm_real_run_smoke" if args.smoke else "calm_real_run"
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    lines = [f"`{command.strip()}` at {payload['provenance']['commit']}", "",
             "| method | steps | train s | f first -> last | g first -> last | q last |",
             "|---|---|---|---|---|---|"]
    for method, run in runs.items():
        first, last = run["first"] or {}, run["last"] or {}

        def pair(key, first=first, last=last):
            a, b = first.get(key), last.get(key)
            return "-" if a is None or b is None else f"{a:.3f} -> {b:.3f}"
        q = last.get("q")
        lines.append(f"| {KIND[method]} | {run['steps']} | {run['seconds']} | {pair('f')} | "
                     f"{pair('g')} | {'-' if q is None else f'{q:.3g}'} |")
    lines += [""] + [format_set(n, e, args.bins) + "\n" for n, e in report.items()]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:3 + len(runs) + 1]))
    print(f"wrote {out / (stem + '.json')} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
