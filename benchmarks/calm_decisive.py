"""Does CALM do what its paper claims? An experiment with the power to say so, or to say it cannot.

    python benchmarks/calm_decisive.py                 # the whole plan; finished runs are reused
    python benchmarks/calm_decisive.py --add calm-bome-all:1 lora-matched:1   # given runs only
    python benchmarks/calm_decisive.py --report        # merge the runs into the result files
    python benchmarks/calm_decisive.py --smoke         # 3 steps, 12 questions per set

Model: SmolLM2-135M-Instruct. Trained on SciQ (``sciq:train``, 150 labeled questions;
``sciq:unlabeled``, 150 calibration questions without labels). In domain: SciQ's whole test
part (700). Out of domain: all of ARC-Easy (570) and a fixed random 1,000 of PIQA's
validation split (seed 0), 1,570 paired questions. Sets whose vanilla accuracy is within
5 points of chance (the mean of 1/K) are reported and left out of every decision.

**The gate** (before any test question is read; training and unlabeled data only):

1. *Letter or cloze.* LoRA (Adam, 1e-3, the step budget) trained on letter answers of
   ``sciq:train``, read on the 150 questions of ``sciq:unlabeled`` with their labels. If a
   one-sided binomial test against chance (1/4) gives p < 0.05, letter mode is the primary
   regime (α on the letter tokens is the paper's class-wise α); otherwise cloze (mean
   per-token score) with α restricted to the tokens of the options (``alpha_tokens=options``).
2. *α that moves.* The BOME arm is probed at each α learning rate of ``--alpha-lr-grid``
   (warm start + ``--probe-steps`` bilevel steps). α moves when the base model with the
   learned α alone changes the mean option entropy on ``sciq:unlabeled`` by at least
   ``--entropy-gate`` nats (0.05). The smallest learning rate that passes is used by every
   α-learning arm; if none passes, the one with the largest change is used and the result
   file says that α stayed inert.

**Arms** (:data:`ARMS`; every setting pinned here and recorded): ``calm-bome-all`` (BOME as
the paper states it: plain SGD over u = (θ, α), f's gradient on both), ``calm-bome-alpha``
(f's gradient on α only: θ moves by λ∇q), ``lora-matched`` (the default arm's exact
schedule, warm start, optimizer, steps and learning rates, with α frozen at the identity),
the paper's ablations ``ablation-iterate`` (θ on g, then (θ, α) on f, no coupling),
``ablation-regularization`` (g + f jointly) and ``ablation-scalar`` (α one temperature), the
training-time baseline CFT (calibration-aware fine-tuning, docs/methods.md: ``cft``, its
calibration loss alone, and ``cft-ce``, cross-entropy plus that term; both are readings of
the authors' published trainer, whose paper text was not available here), and
``vanilla`` (no training). Every arm is also read with temperature scaling fitted in domain on
``sciq:unlabeled`` with its labels (no arm trained on them) and carried over to every set.
Seeds 0, 1, 2 for the default arm, ``lora-matched`` and both CFT arms; one seed for the
ablations. (The CFT arms were added to the plan after the other runs had
been made and read; their settings were fixed before any of their runs.)

**The second round** (settings fixed before any of its runs, after the first round was
read): ``calm-centred`` (τ on centred logits, Adam inner steps, 3 of them at 0.001, so that
θ~ moves and BOME's coupling engages; 20% of the training questions held out and α written
only if it lowers their NLL) and ``calm-centred-daca`` (the same with DACA's masked KL to
Gemma-3-270M as the upper objective, calm's extension), three seeds each, and the scalar
ablation at three seeds. Each is read with the written adapter (``alpha``), with α as trained
before the gate (``trained-alpha``) and without α (``no-alpha``). ``calm-centred`` is the
configuration ``calm train`` ships.

**The default arm** is the BOME arm (``calm-bome-all`` or ``calm-bome-alpha``, seed 0) with
the lower option NLL on the validation split (``sciq:unlabeled`` with its labels); never on
a test part.

**The decision rule**, fixed before the runs. For each claim, Δ = metric(arm) −
metric(comparator), estimated by a paired bootstrap (``--decision-bootstrap`` resamples): seeds are
resampled (paired by seed index where both sides have seeds), then questions within each
set (the same questions for both sides); per set the metric is averaged over the chosen
seeds, and Δ is the question-weighted mean over the claim's sets. With the 95% percentile
interval [lo, hi] and margin m:

* ECE claims (m = 0.01): **holds** if hi < 0 and the interval is not inside ±m;
  **refuted** if lo > 0 or the interval is inside ±m; **inconclusive** otherwise.
* Accuracy kept (non-inferiority, m = 0.03): **holds** if lo > −m; **refuted** if hi < −m;
  **inconclusive** otherwise.
* An ablation collapses (loses accuracy against the default arm, m = 0.03): **holds** if
  hi < −m; **refuted** if lo > −m; **inconclusive** otherwise.
* NLL improvement (second round, m = 0.005): as ECE claims, with m = 0.005.
* No harm in NLL (second round, m = 0.005): **holds** if hi ≤ m; **refuted** if lo > m;
  **inconclusive** otherwise.
* Every comparison with temperature scaling has it on both sides.

Runs missing from the plan give the verdict **not run**. ECE: 10 equal-width bins; NLL and
Brier (multi-class) are reported beside it.

Writes ``OUT/calm_decisive.parts/RUN.json`` per run (resumable: present runs are reused
unless ``--retrain``), and ``--report`` (also run at the end of the plan) writes
``OUT/calm_decisive.json`` and ``.md`` and the README's generated block.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

import numpy as np
from _common import chance_accuracy, command_line, git_commit
from _decisive_design import (
    CALM_TRAIN,
    CANDIDATES,
    CFT_ARMS,
    CFT_LR_EXTEND,
    CFT_LR_GRID,
    COMMON,
    DOMAIN,
    HERE,
    LETTER_LORA,
    LETTER_TUNED,
    OOD,
    arm_settings,
    config_for,
    eval_sets,
    logger,
    make_evaluator,
    mean_entropy,
    parse_run,
    per_question,
    plan,
    read_part,
    summary,
    validation_records,
    write_part,
)
from _decisive_report import (
    report,
)

from calm_runtime.cli.common import install_named
from calm_runtime.errors import FitError
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_runtime.measure import metrics
from calm_runtime.temperature import fit_temperature_scaling
from calm_training.fit import option_probabilities
from calm_training.methods import THETA_ONLY
from calm_training.methods.calm import train_calm


def cft_lr_probe(args, arm: str, lr: float, gate: dict) -> dict:
    """``arm`` trained at seed 0 with learning rate ``lr``, its option NLL on the validation
    split; written as part ``gate-cft-lr-{arm}-{lr}`` (reused when present). At the arm's
    own rate the seed-0 run is the probe."""
    settings = {**arm_settings(arm, gate, None), "outer_lr": lr}
    name = f"gate-cft-lr-{arm}-{lr:g}"
    found = read_part(args, name)
    if found is not None and not args.retrain:
        return found
    run = read_part(args, f"{arm}-s0")
    if run is not None and run["settings"]["outer_lr"] == lr and "diverged" not in run:
        write_part(args, name, {"arm": arm, "outer_lr": lr, "from": f"{arm}-s0",
                                "validation_nll": run["validation_nll"]["alpha"]})
        return read_part(args, name)
    try:
        result = train_calm(config_for(args, settings, 0), None, progress=not args.quiet)
    except FitError as exc:
        write_part(args, name, {"arm": arm, "outer_lr": lr, "diverged": str(exc)})
        return read_part(args, name)
    evaluator = make_evaluator(args, gate["mode"], result.model)
    hidden = evaluator.hidden(validation_records())
    nll = metrics.nll(option_probabilities(evaluator.scores(hidden)[0]), hidden.labels)
    write_part(args, name, {"arm": arm, "outer_lr": lr, "validation_nll": nll,
                            "train_s": round(result.seconds, 1)})
    return read_part(args, name)


def choose_cft_lr(args, gate: dict) -> dict:
    """Each CFT arm's learning rate: the grid's rate with the lower validation NLL."""
    chosen = {}
    for arm in CFT_ARMS:
        grid = list(CFT_LR_GRID)
        probes = [cft_lr_probe(args, arm, lr, gate) for lr in grid]
        for _ in range(CFT_LR_EXTEND):
            stable = [p for p in probes if "diverged" not in p]
            best = min(stable, key=lambda p: p["validation_nll"])
            if grid[0] < best["outer_lr"] < grid[-1]:
                break
            step = float(f"{grid[0] / 3:.3g}") if best["outer_lr"] == grid[0] \
                else float(f"{grid[-1] * 3:.3g}")
            grid = sorted([*grid, step])
            probes.append(cft_lr_probe(args, arm, step, gate))
        stable = [p for p in probes if "diverged" not in p]
        best = min(stable, key=lambda p: p["validation_nll"])
        chosen[arm] = {"outer_lr": best["outer_lr"], "grid": grid,
                       "at_edge": not grid[0] < best["outer_lr"] < grid[-1],
                       "validation_nll": {f"{p['outer_lr']:g}": p.get("validation_nll")
                                          for p in sorted(probes, key=lambda p: p["outer_lr"])}}
    write_part(args, "gate-cft-lr", {"grid": list(CFT_LR_GRID), "arms": chosen,
                                     "extend": CFT_LR_EXTEND,
                                     "rule": "the rate with the lower option NLL on the "
                                             f"validation split ({DOMAIN}:unlabeled with its "
                                             "labels), seed 0; a rate at the grid's edge "
                                             "extends the grid past it (x3)"})
    return read_part(args, "gate-cft-lr")


# ---------------------------------------------------------------------------- the gate
def binomial_p_above(successes: int, n: int, p0: float) -> float:
    """One-sided exact binomial p-value, P(X >= successes) under Binomial(n, p0)."""
    return float(sum(math.comb(n, k) * p0 ** k * (1 - p0) ** (n - k)
                     for k in range(successes, n + 1)))


def letter_gate(args, model: str, name: str, tuned: bool = False) -> dict:
    """A plain LoRA on ``model`` trained on letter answers of the training split, read on the
    validation split: above chance by a one-sided binomial test (p < 0.05), letter mode is a
    regime for that model. Written as part ``name`` (reused when present and holding the
    predicted-letter histogram). ``tuned``: the one tuned attempt (:data:`LETTER_TUNED`)."""
    letter = read_part(args, name)
    if letter is not None and not args.retrain and "predicted_letters" in letter:
        return letter
    args = argparse.Namespace(**{**vars(args), "model": model})
    settings = {**COMMON, **LETTER_LORA, **(LETTER_TUNED if tuned else {}), "mode": "letter",
                "alpha_tokens": "all", "alpha_lr": None, "upper_params": "alpha"}
    started = time.perf_counter()
    result = train_calm(config_for(args, settings, 0), None, progress=not args.quiet)
    letter_eval = make_evaluator(args, "letter", result.model)
    hidden = letter_eval.hidden(validation_records())
    scores, _ = letter_eval.scores(hidden)
    predicted = scores.argmax(axis=1)
    right = int((predicted == hidden.labels).sum())
    n = int(hidden.labels.size)
    k = scores.shape[1]
    write_part(args, name, {
        "model": model, "accuracy": right / n, "n": n, "tuned": tuned,
        "p_value": binomial_p_above(right, n, 0.25), "settings": settings,
        # which letter the LoRA answers, and which is right: one letter always is a collapse
        # onto a prior, not a reading of the question
        "predicted_letters": np.bincount(predicted, minlength=k).tolist(),
        "label_letters": np.bincount(hidden.labels, minlength=k).tolist(),
        "wall_s": round(time.perf_counter() - started, 1)})
    return read_part(args, name)


def run_gate(args) -> dict:
    found = read_part(args, "gate")
    if found is not None and not args.retrain:
        return found
    started = time.perf_counter()
    validation = validation_records()
    # 1. letter or cloze
    letter = letter_gate(args, args.model, "gate-letter")
    right, n, p_value = round(letter["accuracy"] * letter["n"]), letter["n"], letter["p_value"]
    mode = "letter" if p_value < 0.05 else "cloze"
    alpha_tokens = "all" if mode == "letter" else "options"
    logger.warning("gate: LoRA letter accuracy %.3f on %d questions (one-sided p = %.3g): %s",
                   right / n, n, p_value, mode)
    # 2. α that moves
    evaluator = make_evaluator(args, mode)
    evaluator.reset_lora()
    base_hidden = evaluator.hidden(validation)
    base_entropy = mean_entropy(option_probabilities(evaluator.scores(base_hidden)[0]))

    def probe(lr):
        found = read_part(args, f"gate-probe-{lr:g}")
        if found is not None and not args.retrain:
            return found
        gate = {"mode": mode, "alpha_tokens": alpha_tokens, "alpha_lr": lr}
        settings = {**arm_settings("calm-bome-all", gate, None),
                    "steps": COMMON["warm_start_steps"] + args.probe_steps}
        try:
            result = train_calm(config_for(args, settings, 0), None, progress=not args.quiet)
        except FitError as exc:  # a learning rate too large for α: recorded, never chosen
            logger.warning("gate: alpha lr %g diverged (%s)", lr, exc)
            write_part(args, f"gate-probe-{lr:g}", {"alpha_lr": lr, "diverged": str(exc)})
            return read_part(args, f"gate-probe-{lr:g}")
        tau, shift = result.model.tau_shift()
        entropy = mean_entropy(option_probabilities(evaluator.scores(base_hidden, tau, shift)[0]))
        last = result.history[-1]
        logger.warning("gate: alpha lr %g: base+alpha option entropy %.4f (base %.4f)", lr,
                       entropy, base_entropy)
        write_part(args, f"gate-probe-{lr:g}", {
            "alpha_lr": lr, "base_alpha_entropy": entropy,
            "entropy_change": entropy - base_entropy,
            "tau_range": [float(tau.min()), float(tau.max())],
            "shift_range": [float(shift.min()), float(shift.max())],
            "last_lambda": last.get("lam"), "last_cos_f_q": last.get("cos_f_q")})
        return read_part(args, f"gate-probe-{lr:g}")

    probes = [probe(lr) for lr in args.alpha_lr_grid]
    stable = [p for p in probes if "diverged" not in p]
    passing = [p for p in stable if abs(p["entropy_change"]) >= args.entropy_gate]
    diverged = [p["alpha_lr"] for p in probes if "diverged" in p]
    if not passing and stable and diverged:
        # one geometric midpoint between the largest stable rate and the smallest diverging
        # one above it, so that a too-coarse grid does not decide that α cannot move
        top = max(p["alpha_lr"] for p in stable)
        above = [lr for lr in diverged if lr > top]
        if above:
            probes.append(probe(float(f"{math.sqrt(top * min(above)):.3g}")))
    stable = [p for p in probes if "diverged" not in p]
    if not stable:
        raise SystemExit("gate: every α learning rate diverged; lower --alpha-lr-grid")
    moving = [p for p in stable if abs(p["entropy_change"]) >= args.entropy_gate]
    chosen = (min(moving, key=lambda p: p["alpha_lr"]) if moving
              else max(stable, key=lambda p: abs(p["entropy_change"])))
    probes = [{k: v for k, v in p.items() if k not in ("command", "commit", "date")}
              for p in probes]
    gate = {"mode": mode, "alpha_tokens": alpha_tokens, "alpha_lr": chosen["alpha_lr"],
            "alpha_moves": bool(moving), "entropy_gate": args.entropy_gate,
            "base_entropy": base_entropy, "probe_steps": args.probe_steps, "probes": probes,
            "letter": letter, "validation_n": len(validation),
            "wall_s": round(time.perf_counter() - started, 1)}
    write_part(args, "gate", gate)
    return read_part(args, "gate")


# ---------------------------------------------------------------------------- one run
def finished(args, arm: str, seed: int) -> dict | None:
    """The run's part when it is made and current: a CFT run trained at another rate than
    the one chosen on the validation split (``gate-cft-lr``) is to be made again."""
    found = read_part(args, arm if arm == "vanilla" else f"{arm}-s{seed}")
    chosen = read_part(args, "gate-cft-lr")
    if found is not None and arm in CFT_ARMS and chosen is not None and "diverged" not in found \
            and found["settings"]["outer_lr"] != chosen["arms"][arm]["outer_lr"]:
        return None
    return found


def run_one(args, arm: str, seed: int, gate: dict, default: str | None) -> dict:
    name = arm if arm == "vanilla" else f"{arm}-s{seed}"
    found = finished(args, arm, seed)
    if found is not None and not args.retrain:
        logger.info("reusing %s", name)
        return found
    started = time.perf_counter()
    evaluator = make_evaluator(args, gate["mode"])
    validation = validation_records()
    evaluator.reset_lora()
    base_val = evaluator.hidden(validation)
    base_entropy = mean_entropy(option_probabilities(evaluator.scores(base_val)[0]))
    run: dict = {"arm": arm, "seed": seed}
    alphas = {"alpha": (None, None)}
    answer_t: dict = {}  # a reading's answer temperature (cloze: DACA's, on option scores)
    if arm != "vanilla":
        settings = arm_settings(arm, gate, default)
        cft_lr = read_part(args, "gate-cft-lr")
        if arm in CFT_ARMS and cft_lr is not None:  # the rate chosen on the validation split
            settings["outer_lr"] = cft_lr["arms"][arm]["outer_lr"]
        out = Path(args.adapters) / name
        try:
            result = train_calm(config_for(args, settings, seed), out, overwrite=True,
                                progress=not args.quiet)
        except FitError as exc:  # recorded as diverged: a verdict needing it is "not run"
            logger.warning("%s diverged (%s)", name, exc)
            write_part(args, name, {**run, "settings": settings, "diverged": str(exc)})
            return read_part(args, name)
        adapter = CalibrationAdapter.from_pretrained(out)
        training = adapter.metrics["training"]
        last = training["last"] or {}
        tau, shift = adapter.tau, adapter.shift
        center = adapter.centered
        trained = result.trained_alpha
        entropy = mean_entropy(option_probabilities(
            evaluator.scores(base_val, *(trained or (tau, shift)), center=center)[0]))
        run |= {"settings": settings, "adapter": str(out), "train_s": training["seconds"],
                "steps": training["steps"], "tau_range": [float(tau.min()), float(tau.max())],
                "shift_range": [float(shift.min()), float(shift.max())],
                "last": {k: last.get(k) for k in ("f", "g", "g_identity", "q", "lam",
                                                  "cos_f_q", "grad_q_norm", "cft_ce",
                                                  "cft_l_cal") if k in last},
                **({"cft_bins": adapter.method["cft_bins"]}
                   if "cft_bins" in adapter.method else {}),
                "curve": training.get("curve"),
                "base_alpha_entropy_change": entropy - base_entropy,
                **({"alpha_gate": adapter.method["alpha_gate"]}
                   if "alpha_gate" in adapter.method else {}),
                "coupling": training.get("coupling"), "centered": center}
        del result
        evaluator.model.load_lora(adapter.lora_path)
        alphas = {"alpha": (tau, shift)}
        if not settings.get("freeze_alpha") and settings["method"] not in THETA_ONLY:
            alphas["no-alpha"] = (None, None)
            if settings.get("holdout"):  # what α did before the gate decided
                alphas["trained-alpha"] = trained
        daca_fit = adapter.method.get("daca") or {}
        if daca_fit.get("fitted"):  # the adapter as written: α and DACA's T (head, answers)
            head_t = float(adapter.temperature)
            alphas["alpha+daca"] = (np.asarray(tau) * head_t, np.asarray(shift) / head_t)
            answer_t["alpha+daca"] = float(adapter.answer_temperature or 1.0)
        if "daca" in adapter.method:
            run["daca"] = {k: v for k, v in daca_fit.items() if k != "reference_identity"}
        if "holdout_parts" in adapter.metrics:
            run["holdout_parts"] = adapter.metrics["holdout_parts"]
    hidden_val = evaluator.hidden(validation)
    temperatures, validation_nll = {}, {}
    center = run.get("centered", False)
    for variant, (tau, shift) in alphas.items():
        s = evaluator.scores(hidden_val, tau, shift, center=center)[0] / answer_t.get(variant, 1.0)
        temperatures[variant] = fit_temperature_scaling(s, hidden_val.labels).temperature
        validation_nll[variant] = metrics.nll(option_probabilities(s), hidden_val.labels)
    run |= {"temperature": temperatures, "validation_nll": validation_nll, "sets": {}}
    for set_name, records in eval_sets(args.eval_limit).items():
        hidden = evaluator.hidden(records, progress=not args.quiet)
        k = max(len(r.choices) for r in records)
        chance = chance_accuracy(records)
        out_set = {"in_domain": set_name == DOMAIN, "k": k, "chance": chance, "variants": {}}
        for variant, (tau, shift) in alphas.items():
            scores = (evaluator.scores(hidden, tau, shift, center=center)[0]
                      / answer_t.get(variant, 1.0))
            for suffix, t in (("", 1.0), ("+ts", temperatures[variant])):
                q = per_question(option_probabilities(scores, t), hidden.labels)
                out_set["variants"][variant + suffix] = {
                    "summary": summary(q, k, chance, args.bins, args.bootstrap),
                    "questions": q}
        run["sets"][set_name] = out_set
        logger.info("%s on %s evaluated", name, set_name)
    run["wall_s"] = round(time.perf_counter() - started, 1)
    write_part(args, name, run)
    return read_part(args, name)


def choose_default(args, gate: dict) -> dict | None:
    found = read_part(args, "default")
    if found is not None and not args.retrain:
        return found
    runs = {arm: read_part(args, f"{arm}-s0") for arm in CANDIDATES}
    if any(r is None for r in runs.values()):
        return None
    nll = {arm: r["validation_nll"]["alpha"] for arm, r in runs.items() if "diverged" not in r}
    if not nll:
        raise SystemExit("both BOME candidates diverged; no default arm (see their parts)")
    arm = min(nll, key=nll.get)
    write_part(args, "default", {"arm": arm, "validation_nll": nll,
                                 "rule": "the BOME arm with the lower option NLL on the "
                                 f"validation split ({DOMAIN}:unlabeled with its labels), seed 0"})
    return read_part(args, "default")


def run_plan(args) -> int:
    gate = run_gate(args)
    wanted = [parse_run(text) for text in args.add] if args.add else None
    while True:
        chosen = choose_default(args, gate)
        default = chosen["arm"] if chosen else None
        todo = plan(default) if wanted is None else wanted
        pending = [(a, s) for a, s in todo if args.retrain or finished(args, a, s) is None]
        if not pending:
            break
        arm, seed = pending[0]
        run_one(args, arm, seed, gate, default)
        if wanted is not None:
            wanted.remove((arm, seed))
        if args.retrain:
            args.retrain = False  # once per run, not forever
    return report(args)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--add", nargs="+", metavar="ARM[:SEED]",
                        help="make only these runs (after the gate), then report")
    parser.add_argument("--report", action="store_true", help="merge the runs made so far")
    parser.add_argument("--letter-gate", metavar="MODEL",
                        help="only run the letter-mode gate for MODEL (another packaged model "
                             "that might answer letters above chance), then report")
    parser.add_argument("--letter-tuned", action="store_true",
                        help="with --letter-gate: the one tuned letter LoRA attempt "
                             "(LETTER_TUNED) instead of the gate's LoRA")
    parser.add_argument("--cft-lr", action="store_true",
                        help="only choose the CFT arms' learning rates on the validation "
                             "split (seed-0 probes over CFT_LR_GRID), then report")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--alpha-lr-grid", type=float, nargs="+", default=[0.02, 0.2, 2.0])
    parser.add_argument("--entropy-gate", type=float, default=0.05)
    parser.add_argument("--probe-steps", type=int, default=10)
    parser.add_argument("--eval-limit", type=int, default=None)
    parser.add_argument("--eval-batch-size", type=int, default=16)
    parser.add_argument("--bins", type=int, default=10)
    parser.add_argument("--bootstrap", type=int, default=1000,
                        help="resamples of each ECE interval in the run tables")
    parser.add_argument("--decision-bootstrap", type=int, default=2000,
                        help="resamples of each claim's paired interval")
    parser.add_argument("--smoke", action="store_true", help="3 steps, 12 questions per set")
    parser.add_argument("--retrain", action="store_true", help="redo runs that exist")
    parser.add_argument("--adapters",
                        default=str(HERE.parent / "calm-out" / "calm-decisive" / "adapters"))
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--readme", default=str(HERE.parent / "docs" / "results.md"),
                        help="--report rewrites this file's generated block")
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    args.command = command_line("calm_decisive.py", argv)
    args.design = __doc__  # the report quotes its decision rule
    args.commit = git_commit()
    args.parts = str(Path(args.out) / "calm_decisive.parts")
    if args.smoke:
        COMMON.update(steps=3, warm_start_steps=1)
        CALM_TRAIN.update(steps=3, warm_start_steps=1)
        args.probe_steps, args.eval_limit, args.bootstrap = 1, 12, 50
        args.decision_bootstrap = 50
        args.adapters = args.adapters.replace("calm-decisive", "calm-decisive-smoke")
        if args.out == str(HERE / "results"):  # a smoke run never replaces the results
            args.out = str(HERE.parent / "calm-out" / "calm-decisive-smoke")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        args.parts = str(Path(args.out) / "calm_decisive_smoke.parts")
        args.readme = ""
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.report:
        return report(args)
    if args.cft_lr:
        install_named([args.model], (DOMAIN,))
        choose_cft_lr(args, run_gate(args))
        return report(args)
    if args.letter_gate:
        install_named([args.letter_gate], (DOMAIN,))
        name = "gate-letter" if args.letter_gate == args.model else \
            f"gate-letter-{args.letter_gate}"
        if args.letter_tuned:
            name = f"gate-letter-tuned-{args.letter_gate}"
        letter_gate(args, args.letter_gate, name, tuned=args.letter_tuned)
        return report(args)
    install_named([args.model], (DOMAIN, *OOD))
    return run_plan(args)


if __name__ == "__main__":
    sys.exit(main())
