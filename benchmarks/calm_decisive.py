"""Does CALM do what its paper claims? An experiment with the power to say so, or to say it cannot.

    python benchmarks/calm_decisive.py                 # the whole plan; finished runs are reused
    python benchmarks/calm_decisive.py --add calm-bome-all:1 lora-matched:1   # given runs only
    python benchmarks/calm_decisive.py --report        # merge the runs into the result files
    python benchmarks/calm_decisive.py --smoke         # 3 steps, 12 questions per set

Model: SmolLM2-135M-Instruct. Trained on SciQ (``sciq:train``, 150 labeled questions;
``sciq:unlabeled``, 150 calibration questions without labels). In domain: SciQ's whole test
part (700). Out of domain: all of ARC-Easy (570) and a fixed random 1,000 of PIQA's
validation split (seed 0), 1,570 paired questions. Sets whose vanilla accuracy is within
5 points of chance (1/K) are reported and left out of every decision.

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
import json
import logging
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
from _common import command_line, git_commit, portable, rewrite_generated_block

from calm_runtime.cli.main import install_named
from calm_runtime.data.sets import load_dataset, split_records
from calm_runtime.errors import FitError
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_runtime.measure import metrics
from calm_runtime.temperature import fit_temperature_scaling
from calm_training.calm import data as calm_data
from calm_training.calm.config import THETA_ONLY
from calm_training.calm.trainer import CalmConfig, train_calm
from calm_training.fit import option_probabilities

HERE = Path(__file__).resolve().parent
logger = logging.getLogger("calm_decisive")

DOMAIN = "sciq"
OOD = ("arc-easy", "piqa")
#: how many questions of each out-of-domain set (None: all), drawn once with PIQA_SEED
OOD_LIMIT = {"arc-easy": None, "piqa": 1000}
SUBSET_SEED = 0
SEEDS = (0, 1, 2)
CHANCE_MARGIN = 0.05
ECE_MARGIN = 0.01
ACC_MARGIN = 0.03
#: NLL claims (the second round): α's harm is bounded by this margin, its gain must clear it
NLL_MARGIN = 0.005

#: every CalmConfig setting an arm can change, pinned (mode, alpha_tokens and alpha_lr come
#: from the gate; the rest never depends on a CalmConfig default)
COMMON = {"steps": 40, "warm_start_steps": 20, "warm_start_lr": 1e-3, "batch_size": 8,
          "calibration_batch_size": 8, "lora_rank": 8, "lora_alpha": 16.0, "max_length": 256,
          "inner_steps": 2, "inner_lr": 0.01, "optimizer": "sgd", "momentum": 0.0,
          "outer_lr": 0.1, "phi": "grad", "eta": 0.5, "entropy": "options",
          "cloze_variant": "mean", "calibration_positions": "answer", "alpha_l2": 0.0,
          "q_window": 10, "beta": 1.0, "freeze_alpha": False, "cft_weight": 0.5,
          "cft_scale": 1e-3, "cft_bins": 10,
          # settings added after the first runs, at the behaviour those runs had
          "inner_optimizer": "sgd", "alpha_logits": "raw", "upper": "entropy",
          "reference": None, "holdout": 0.0, "daca": False}
#: calibration-aware fine-tuning (the paper's training-time baseline; docs/methods.md): the
#: plain fine-tuning recipe of this project (Adam at the warm start's rate, every step, no α)
#: on its loss (1 − w)·CE + w·c·L_cal with the published trainer's c and bins
CFT = {"method": "cft", "optimizer": "adam", "outer_lr": 1e-3, "warm_start_steps": 0}
ROUND2 = {"method": "bilevel", "upper_params": "alpha", "inner_optimizer": "adam",
          "inner_steps": 3, "inner_lr": 1e-3, "alpha_logits": "centered", "holdout": 0.2}
ARMS = {
    "calm-bome-all": {"method": "bilevel", "upper_params": "all"},
    "calm-bome-alpha": {"method": "bilevel", "upper_params": "alpha"},
    # the default arm's settings with α frozen at the identity
    "lora-matched": {"freeze_alpha": True},
    "ablation-iterate": {"method": "iterate-theta"},
    "ablation-regularization": {"method": "regularization"},
    "ablation-scalar": {"method": "scalar"},
    # the calibration loss alone (w = 1, the published scripts' α = 1)
    "cft": {**CFT, "cft_weight": 1.0},
    # cross-entropy plus the calibration term (w = 0.5, the published trainer's default)
    "cft-ce": {**CFT, "cft_weight": 0.5},
    # the second round (added after the first round was read; settings fixed before any of
    # its runs): τ on centred logits, Adam inner steps so that the coupling engages, and
    # the do-no-harm gate on 20% of the training questions; the entropy upper objective
    # (the paper's) and DACA's masked KL to the pre-trained Gemma-3-270M (calm's extension)
    "calm-centred": dict(ROUND2),
    "calm-centred-daca": {**ROUND2, "upper": "daca", "reference": "gemma-3-270m"},
    # the second round's settings with α frozen at the identity (the same held-out training
    # questions): θ trained without α, against which α's share is read a second way
    "calm-centred-frozen": {**ROUND2, "freeze_alpha": True},
}
#: the third round: what `calm train` handed users when it ran (commit c87ea82), every
#: setting pinned: 200 steps, α on the whole vocabulary at the SGD default α rate, the entropy
#: upper objective, α's gate on a 20% hold-out, and the DACA temperature against the model
#: before the LoRA, then ungated and in the head. Today's defaults (a 400-question hold-out
#: gating α and T, T on the option scores) are read by benchmarks/calm_train_ood.py
CALM_TRAIN = {"method": "bilevel", "mode": "cloze", "steps": 200, "batch_size": 8,
              "calibration_batch_size": None, "inner_steps": 3, "inner_lr": None,
              "inner_optimizer": "adam", "outer_lr": None, "alpha_lr": None, "optimizer": None,
              "momentum": 0.0, "phi": "grad", "eta": 0.5, "warm_start_steps": None,
              "warm_start_lr": 1e-3, "entropy": "options", "cloze_variant": "mean",
              "upper_params": "alpha", "alpha_tokens": "all", "alpha_l2": 0.0,
              "alpha_logits": "centered", "upper": "entropy", "reference": None, "daca": True,
              "holdout": 0.2, "freeze_alpha": False, "cft_weight": 0.5,
              "cft_scale": 1e-3, "cft_bins": 10, "q_window": 10, "beta": 1.0, "lora_rank": 8,
              "lora_alpha": 16.0, "max_length": 256, "calibration_positions": "options"}
ARMS["calm-train"] = CALM_TRAIN
#: the configuration `calm train` ships: its defaults, run as users run them
SHIPPED = "calm-train"
ROUND2_ARMS = ("calm-centred", "calm-centred-daca")
#: the second round's α-frozen control (θ trained without α), read against calm-centred
ROUND2_CONTROL = "calm-centred-frozen"
ROUND3_ARMS = ("calm-train",)
#: arms whose settings start from the default arm's (the rest start from COMMON)
DERIVED = ("lora-matched", "ablation-iterate", "ablation-regularization", "ablation-scalar")
CANDIDATES = ("calm-bome-all", "calm-bome-alpha")
#: CFT's learning rate is chosen on the validation split like the other arms' settings: each
#: CFT arm is trained at seed 0 at every rate of this grid and read on ``sciq:unlabeled``
#: with its labels; the rate with the lower option NLL is the arm's (``--cft-lr``). The
#: seed-0 run at the arm's recorded rate (1e-3) is that rate's probe.
CFT_ARMS = ("cft", "cft-ce")
CFT_LR_GRID = (3e-4, 1e-3, 3e-3)
#: a rate chosen at the grid's edge is not a choice: the grid is extended past that edge by
#: the grid's own factor (×3), up to this many times, until the chosen rate is inside it
CFT_LR_EXTEND = 2
LETTER_LORA = {"method": "lora", "optimizer": "adam", "outer_lr": 1e-3, "warm_start_steps": 0}
#: the one tuned letter attempt, fixed before it ran: five times the steps at a third of the
#: rate (the 40-step LoRA answers one letter for every question, a collapse onto a letter
#: prior that a longer, gentler run may leave)
LETTER_TUNED = {"steps": 200, "outer_lr": 3e-4}


def arm_settings(arm: str, gate: dict, default: str | None) -> dict:
    """The full, pinned settings of ``arm`` (every key of :data:`COMMON` and more)."""
    base = {**COMMON, "mode": gate["mode"], "alpha_tokens": gate["alpha_tokens"],
            "alpha_lr": gate["alpha_lr"], "upper_params": "all", "method": "bilevel"}
    if arm in ROUND3_ARMS:  # every setting pinned by the arm itself (CALM_TRAIN)
        return dict(ARMS[arm])
    if arm in DERIVED:
        if default is None:
            raise SystemExit(f"{arm} derives from the default arm, which is chosen after "
                             f"{' and '.join(f'{c}:0' for c in CANDIDATES)}; run those first")
        base = arm_settings(default, gate, None)
    return {**base, **ARMS[arm]}


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
        result = train_calm(_config(args, settings, 0), None, progress=not args.quiet)
    except FitError as exc:
        write_part(args, name, {"arm": arm, "outer_lr": lr, "diverged": str(exc)})
        return read_part(args, name)
    evaluator = _evaluator(args, gate["mode"], result.model)
    hidden = evaluator.hidden(_validation())
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


def _config(args, settings: dict, seed: int) -> CalmConfig:
    return CalmConfig(model=args.model, train=(f"{DOMAIN}:train",),
                      calibration=(f"{DOMAIN}:unlabeled",), seed=seed, **settings)


# ---------------------------------------------------------------------------- data
def _validation():
    """``sciq:unlabeled`` with its labels: TS fit, default choice, gate readings."""
    return split_records(load_dataset(f"{DOMAIN}:calibration"), calm_data.TRAIN_SPLIT_FRACTION,
                         calm_data.TRAIN_SPLIT_SEED)[1]


def eval_sets(limit: int | None = None) -> dict:
    sets = {DOMAIN: load_dataset(f"{DOMAIN}:test")}
    for name in OOD:
        records = load_dataset(name)
        if OOD_LIMIT[name] is not None:
            order = list(range(len(records)))
            random.Random(SUBSET_SEED).shuffle(order)
            records = [records[i] for i in sorted(order[:OOD_LIMIT[name]])]
        sets[name] = records
    return {k: v[:limit] for k, v in sets.items()} if limit else sets


def _evaluator(args, mode: str, model=None):
    """An option evaluator on ``model`` (a trained CalmModel) or on a fresh base model with an
    empty LoRA of the arms' shape."""
    import torch

    from calm_training.calm.model import CalmModel
    from calm_training.calm.option_eval import OptionEvaluator
    from calm_training.scoring.local import uses_chat_template

    if model is None:
        config = CalmConfig(model=args.model, train=("-",), calibration=("-",),
                            method="bilevel", lora_rank=COMMON["lora_rank"],
                            lora_alpha=COMMON["lora_alpha"])
        model = CalmModel(config, torch.device("cpu"))
    chat = mode == "letter" and uses_chat_template(model.tokenizer, None)
    return OptionEvaluator(model, mode=mode, variant=COMMON["cloze_variant"], chat=chat,
                           max_length=COMMON["max_length"], batch_size=args.eval_batch_size)


def _entropy(probs: np.ndarray) -> float:
    p = np.clip(probs, 1e-12, 1.0)
    return float(-(probs * np.log(p)).sum(axis=1).mean())


def per_question(probs: np.ndarray, labels: np.ndarray) -> dict:
    """conf, correct, nll, brier per question (rounded: the part files stay small)."""
    n = labels.size
    conf = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == labels).astype(int)
    p_true = np.clip(probs[np.arange(n), labels], metrics.PROB_EPS, 1.0)
    onehot = np.zeros_like(probs)
    onehot[np.arange(n), labels] = 1.0
    brier = ((probs - onehot) ** 2).sum(axis=1)
    return {"conf": np.round(conf, 6).tolist(), "correct": correct.tolist(),
            "nll": np.round(-np.log(p_true), 6).tolist(), "brier": np.round(brier, 6).tolist()}


def summary(q: dict, k: int, bins: int, n_boot: int) -> dict:
    """One reading's metrics; ECE's 95% interval is the bias-corrected bootstrap (binned ECE
    is biased upward on resamples; metrics.bootstrap_interval)."""
    conf, correct = np.asarray(q["conf"]), np.asarray(q["correct"], float)
    lo, hi = metrics.bootstrap_interval(lambda c, y: metrics.ece(c, y, bins), conf, correct,
                                        n_resamples=n_boot, bias_corrected=True)
    acc = float(correct.mean())
    return {"n": int(conf.size), "accuracy": acc, "ece": float(metrics.ece(conf, correct, bins)),
            "ece_ci": [lo, hi], "ece_ci_kind": "bias-corrected percentile",
            "nll": float(np.mean(q["nll"])),
            "brier": float(np.mean(q["brier"])), "mean_confidence": float(conf.mean()),
            "near_chance": acc < 1.0 / k + CHANCE_MARGIN, "k": k}


# ---------------------------------------------------------------------------- parts
def _part_path(args, name: str) -> Path:
    return Path(args.parts) / f"{name}.json"


def read_part(args, name: str) -> dict | None:
    path = _part_path(args, name)
    return json.loads(path.read_text()) if path.is_file() else None


def write_part(args, name: str, part: dict) -> None:
    path = _part_path(args, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = {"command": args.command, "commit": args.commit,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **part}
    tmp = path.with_suffix(".tmp")
    # the adapter folders it names are the machine's: named by their last part
    tmp.write_text(portable(json.dumps(part, separators=(",", ":"), default=str)) + "\n")
    tmp.replace(path)
    logger.warning("wrote %s", path)


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
    result = train_calm(_config(args, settings, 0), None, progress=not args.quiet)
    letter_eval = _evaluator(args, "letter", result.model)
    hidden = letter_eval.hidden(_validation())
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
    validation = _validation()
    # 1. letter or cloze
    letter = letter_gate(args, args.model, "gate-letter")
    right, n, p_value = round(letter["accuracy"] * letter["n"]), letter["n"], letter["p_value"]
    mode = "letter" if p_value < 0.05 else "cloze"
    alpha_tokens = "all" if mode == "letter" else "options"
    logger.warning("gate: LoRA letter accuracy %.3f on %d questions (one-sided p = %.3g): %s",
                   right / n, n, p_value, mode)
    # 2. α that moves
    evaluator = _evaluator(args, mode)
    evaluator.reset_lora()
    base_hidden = evaluator.hidden(validation)
    base_entropy = _entropy(option_probabilities(evaluator.scores(base_hidden)[0]))

    def probe(lr):
        found = read_part(args, f"gate-probe-{lr:g}")
        if found is not None and not args.retrain:
            return found
        gate = {"mode": mode, "alpha_tokens": alpha_tokens, "alpha_lr": lr}
        settings = {**arm_settings("calm-bome-all", gate, None),
                    "steps": COMMON["warm_start_steps"] + args.probe_steps}
        try:
            result = train_calm(_config(args, settings, 0), None, progress=not args.quiet)
        except FitError as exc:  # a learning rate too large for α: recorded, never chosen
            logger.warning("gate: alpha lr %g diverged (%s)", lr, exc)
            write_part(args, f"gate-probe-{lr:g}", {"alpha_lr": lr, "diverged": str(exc)})
            return read_part(args, f"gate-probe-{lr:g}")
        tau, shift = result.model.tau_shift()
        entropy = _entropy(option_probabilities(evaluator.scores(base_hidden, tau, shift)[0]))
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
    evaluator = _evaluator(args, gate["mode"])
    validation = _validation()
    evaluator.reset_lora()
    base_val = evaluator.hidden(validation)
    base_entropy = _entropy(option_probabilities(evaluator.scores(base_val)[0]))
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
            result = train_calm(_config(args, settings, seed), out, overwrite=True,
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
        entropy = _entropy(option_probabilities(
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
        out_set = {"in_domain": set_name == DOMAIN, "k": k, "variants": {}}
        for variant, (tau, shift) in alphas.items():
            scores = (evaluator.scores(hidden, tau, shift, center=center)[0]
                      / answer_t.get(variant, 1.0))
            for suffix, t in (("", 1.0), ("+ts", temperatures[variant])):
                q = per_question(option_probabilities(scores, t), hidden.labels)
                out_set["variants"][variant + suffix] = {
                    "summary": summary(q, k, args.bins, args.bootstrap), "questions": q}
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


def plan(default: str | None) -> list[tuple[str, int]]:
    """The runs in the order they are made (the default-derived ones once it is known)."""
    runs = [("vanilla", 0)] + [(c, 0) for c in CANDIDATES]
    if default is None:
        return runs
    for seed in SEEDS:
        runs += [(default, seed), ("lora-matched", seed)]
    runs += [(a, 0) for a in ("ablation-iterate", "ablation-regularization", "ablation-scalar")]
    runs += [("cft", seed) for seed in SEEDS] + [("cft-ce", seed) for seed in SEEDS]
    # the second round: both new arms and the scalar ablation at three seeds each
    for seed in SEEDS:
        runs += [(arm, seed) for arm in ROUND2_ARMS] + [("ablation-scalar", seed)]
    # the third round: `calm train` as users run it, three seeds
    runs += [(arm, seed) for seed in SEEDS for arm in ROUND3_ARMS]
    # the second round's α-frozen control, three seeds
    runs += [(ROUND2_CONTROL, seed) for seed in SEEDS]
    return list(dict.fromkeys(runs))


def run_plan(args) -> int:
    gate = run_gate(args)
    wanted = [_parse_run(text) for text in args.add] if args.add else None
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


def _parse_run(text: str) -> tuple[str, int]:
    arm, _, seed = text.partition(":")
    if arm not in ARMS and arm != "vanilla":
        raise SystemExit(f"--add {text}: unknown arm {arm!r}; choose from vanilla, "
                         f"{', '.join(ARMS)}")
    if seed and not seed.isdigit():
        raise SystemExit(f"--add {text}: the seed must be a whole number (ARM:SEED)")
    return arm, int(seed or 0)


# ---------------------------------------------------------------------------- decisions
def _arrays(part: dict, set_name: str, variant: str) -> dict:
    q = part["sets"][set_name]["variants"][variant]["questions"]
    return {k: np.asarray(v, float) for k, v in q.items()}


def _metric(a: dict, metric: str, idx: np.ndarray, bins: int) -> float:
    if metric == "ece":
        return float(metrics.ece(a["conf"][idx], a["correct"][idx], bins))
    if metric == "accuracy":
        return float(a["correct"][idx].mean())
    return float(a[metric][idx].mean())


def paired_delta(side_a: list[dict], side_b: list[dict], sets: list[str], metric: str,
                 n_boot: int, bins: int = 10, seed: int = 0) -> dict:
    """Δ = metric(a) − metric(b): point estimate and 95% interval (module docstring).

    ``side_a`` and ``side_b`` are per-seed lists of ``{set: arrays}``; a side with one
    element is used as is in every resample, two sides of equal length are paired by index.
    """
    rng = np.random.default_rng(seed)
    n = {s: side_a[0][s]["conf"].size for s in sets}
    weights = np.array([n[s] for s in sets], float) / sum(n.values())

    def estimate(seeds_a, seeds_b, questions):
        deltas = []
        for s in sets:
            idx = questions[s]
            ma = np.mean([_metric(side_a[i][s], metric, idx, bins) for i in seeds_a])
            mb = np.mean([_metric(side_b[i][s], metric, idx, bins) for i in seeds_b])
            deltas.append(ma - mb)
        return float(np.dot(weights, deltas))

    everything = {s: np.arange(n[s]) for s in sets}
    point = estimate(range(len(side_a)), range(len(side_b)), everything)
    paired = len(side_a) == len(side_b)
    draws = []
    for _ in range(n_boot):
        sa = rng.integers(0, len(side_a), len(side_a))
        sb = sa if paired else rng.integers(0, len(side_b), len(side_b))
        questions = {s: rng.integers(0, n[s], n[s]) for s in sets}
        draws.append(estimate(sa, sb, questions))
    lo, hi = np.percentile(draws, [2.5, 97.5])
    # the smallest difference this design finds with 80% power at two-sided 5%
    detects = float((1.96 + 0.84) * np.std(draws, ddof=1)) if n_boot > 1 else None
    return {"delta": point, "ci": [float(lo), float(hi)], "seeds": [len(side_a), len(side_b)],
            "n": int(sum(n.values())), "detects": detects}


def verdict(kind: str, lo: float, hi: float) -> str:
    if kind == "ece":
        inside = -ECE_MARGIN < lo and hi < ECE_MARGIN
        if lo > 0 or inside:
            return "refuted"
        return "holds" if hi < 0 else "inconclusive"
    if kind == "kept":
        return "holds" if lo > -ACC_MARGIN else "refuted" if hi < -ACC_MARGIN else "inconclusive"
    if kind == "collapses":
        return "holds" if hi < -ACC_MARGIN else "refuted" if lo > -ACC_MARGIN else "inconclusive"
    if kind == "nll":  # an improvement: as ECE, with NLL's margin
        if lo > 0 or (-NLL_MARGIN < lo and hi < NLL_MARGIN):
            return "refuted"
        return "holds" if hi < 0 else "inconclusive"
    if kind == "no-harm":  # non-inferiority: NLL rises by less than the margin
        return "holds" if hi <= NLL_MARGIN else "refuted" if lo > NLL_MARGIN else "inconclusive"
    raise ValueError(kind)


def claims(parts: dict, default: str | None, n_boot: int, bins: int) -> list[dict]:
    """The paper's claims (and α's own share), each with its verdict and interval."""
    vanilla = parts.get("vanilla")
    ood = [s for s in OOD if vanilla and not
           vanilla["sets"][s]["variants"]["alpha"]["summary"]["near_chance"]]

    def side(arm, variant, sets):
        found = [parts[f"{arm}-s{s}"] for s in SEEDS if f"{arm}-s{s}" in parts] \
            if arm != "vanilla" else ([vanilla] if vanilla else [])
        return [{s: _arrays(p, s, variant) for s in sets} for p in found]

    specs = [
        ("OOD conf-ECE below lora-matched, TS on both", "ece", "ece", (default, "alpha+ts"),
         ("lora-matched", "alpha+ts"), ood),
        ("OOD conf-ECE below vanilla, TS on both", "ece", "ece", (default, "alpha+ts"),
         ("vanilla", "alpha+ts"), ood),
        ("OOD conf-ECE below lora-matched (no TS)", "ece", "ece", (default, "alpha"),
         ("lora-matched", "alpha"), ood),
        ("α's own share: OOD ECE with α below the same θ without α", "ece", "ece",
         (default, "alpha"), (default, "no-alpha"), ood),
        ("α's own share: OOD NLL with α below the same θ without α", "nll", "nll",
         (default, "alpha"), (default, "no-alpha"), ood),
        ("accuracy kept in domain (vs lora-matched)", "kept", "accuracy", (default, "alpha"),
         ("lora-matched", "alpha"), [DOMAIN]),
        ("accuracy kept out of domain (vs lora-matched)", "kept", "accuracy",
         (default, "alpha"), ("lora-matched", "alpha"), ood),
        ("in domain: ECE below vanilla", "ece", "ece", (default, "alpha"), ("vanilla", "alpha"),
         [DOMAIN]),
        ("in domain: accuracy kept vs vanilla", "kept", "accuracy", (default, "alpha"),
         ("vanilla", "alpha"), [DOMAIN]),
        ("iterate ablation collapses in accuracy (vs default arm)", "collapses", "accuracy",
         ("ablation-iterate", "alpha"), (default, "alpha"), [DOMAIN]),
        ("regularization ablation collapses in accuracy (vs default arm)", "collapses",
         "accuracy", ("ablation-regularization", "alpha"), (default, "alpha"), [DOMAIN]),
        # the scalar ablation's one temperature collapsed high (τ ≈ 6.5, which TS undoes):
        # without TS this compares against a collapsed scalar, with TS on both it compares
        # what per-vocabulary α adds beyond one temperature
        ("OOD ECE below the scalar ablation (no TS; its one learned τ collapsed high)",
         "ece", "ece", (default, "alpha"), ("ablation-scalar", "alpha"), ood),
        ("per-vocabulary α beats one learned temperature, TS on both: OOD ECE below the "
         "scalar ablation", "ece", "ece", (default, "alpha+ts"), ("ablation-scalar",
                                                                   "alpha+ts"), ood),
        # CFT's primary comparator: cross-entropy plus the calibration term (the published
        # form), with and without TS
        ("OOD conf-ECE below CFT (CE + calibration term)", "ece", "ece", (default, "alpha"),
         ("cft-ce", "alpha"), ood),
        ("OOD conf-ECE below CFT (CE + calibration term), TS on both", "ece", "ece",
         (default, "alpha+ts"), ("cft-ce", "alpha+ts"), ood),
        ("OOD conf-ECE below CFT (calibration loss alone)", "ece", "ece", (default, "alpha"),
         ("cft", "alpha"), ood),
        ("OOD conf-ECE below CFT (calibration loss alone), TS on both", "ece", "ece",
         (default, "alpha+ts"), ("cft", "alpha+ts"), ood),
        ("accuracy kept out of domain (vs CFT, calibration loss alone)", "kept", "accuracy",
         (default, "alpha"), ("cft", "alpha"), ood),
        # "CALM is the only training-time method that improves both in domain": CFT's rows
        ("in domain: CFT (calibration loss alone) ECE below vanilla", "ece", "ece",
         ("cft", "alpha"), ("vanilla", "alpha"), [DOMAIN]),
        ("in domain: CFT (calibration loss alone) accuracy kept vs vanilla", "kept",
         "accuracy", ("cft", "alpha"), ("vanilla", "alpha"), [DOMAIN]),
        *round_two(ood),
        *round_three(ood),
    ]
    out = []
    for text, kind, metric, (arm_a, var_a), (arm_b, var_b), sets in specs:
        row = {"claim": text, "kind": kind, "metric": metric, "arm": f"{arm_a}/{var_a}",
               "comparator": f"{arm_b}/{var_b}", "sets": sets}
        a = side(arm_a, var_a, sets) if arm_a and sets else []
        b = side(arm_b, var_b, sets) if arm_b and sets else []
        if not a or not b:
            out.append({**row, "verdict": "not run"})
            continue
        if _identical(a, b):  # e.g. the gate wrote the identity: nothing to compare
            out.append({**row, "verdict": "n/a (identical readings)", "seeds": [len(a), len(b)],
                        "n": int(sum(a[0][s]["conf"].size for s in sets))})
            continue
        d = paired_delta(a, b, sets, metric, n_boot, bins)
        out.append({**row, **d, "verdict": verdict(kind, *d["ci"])})
    return out


def _identical(a: list[dict], b: list[dict]) -> bool:
    """Whether two sides hold the same per-question arrays, seed by seed."""
    return len(a) == len(b) and all(
        np.array_equal(x[s][k], y[s][k]) for x, y in zip(a, b, strict=True) for s in x
        for k in ("conf", "correct", "nll"))


def round_two(ood: list[str]) -> list[tuple]:
    """The second round's claims: for each new arm, α's own share as trained (before the
    gate) on ECE, NLL and accuracy, and the shipped adapter's (after the gate) on NLL."""
    specs = []
    for arm in ROUND2_ARMS:
        specs += [
            (f"{arm}: α's own share (as trained), OOD ECE below the same θ without α", "ece",
             "ece", (arm, "trained-alpha"), (arm, "no-alpha"), ood),
            (f"{arm}: α's own share (as trained), OOD NLL below the same θ without α", "nll",
             "nll", (arm, "trained-alpha"), (arm, "no-alpha"), ood),
            (f"{arm}: α (as trained) keeps OOD accuracy", "kept", "accuracy",
             (arm, "trained-alpha"), (arm, "no-alpha"), ood),
            (f"{arm}: the written adapter's α does not raise OOD NLL (by {NLL_MARGIN})",
             "no-harm", "nll", (arm, "alpha"), (arm, "no-alpha"), ood),
            (f"{arm}: in domain, α's own share (as trained), NLL below the same θ without α",
             "nll", "nll", (arm, "trained-alpha"), (arm, "no-alpha"), [DOMAIN])]
    # α's share read a second way: against a θ trained without α at all (the same settings
    # and held-out questions, α frozen), so that θ's training with α is part of what is read
    arm, control = ROUND2_ARMS[0], (ROUND2_CONTROL, "alpha")
    specs += [
        (f"{arm} (as trained) against θ trained without α ({ROUND2_CONTROL}): OOD ECE below",
         "ece", "ece", (arm, "trained-alpha"), control, ood),
        (f"{arm} (as trained) against θ trained without α ({ROUND2_CONTROL}): OOD NLL below",
         "nll", "nll", (arm, "trained-alpha"), control, ood),
        (f"{arm} (as trained) against θ trained without α ({ROUND2_CONTROL}): OOD accuracy "
         "kept", "kept", "accuracy", (arm, "trained-alpha"), control, ood),
        (f"{arm} (as written) against θ trained without α ({ROUND2_CONTROL}): OOD NLL not "
         f"raised (by {NLL_MARGIN})", "no-harm", "nll", (arm, "alpha"), control, ood)]
    return specs


#: the third round's readings of a `calm train` run, in the order its parts are added
ROUND3_READINGS = (("vanilla", "alpha", "vanilla (the model as given)"),
                   (SHIPPED, "no-alpha", "LoRA alone"),
                   (SHIPPED, "alpha", "LoRA + gated α"),
                   (SHIPPED, "alpha+daca", "LoRA + gated α + DACA T (what `calm train` writes)"),
                   (SHIPPED, "no-alpha+ts", "LoRA + labeled TS (in-domain labels)"))


def round_three(ood: list[str]) -> list[tuple]:
    """The third round's claims: what `calm train`'s output (LoRA, gated α, DACA T against
    the model before the LoRA) does out of domain against the model it was given and against
    each of its parts."""
    arm, written = SHIPPED, (SHIPPED, "alpha+daca")
    return [
        (f"{arm}: the written adapter's OOD ECE below vanilla", "ece", "ece", written,
         ("vanilla", "alpha"), ood),
        (f"{arm}: the written adapter's OOD ECE below LoRA alone", "ece", "ece", written,
         (arm, "no-alpha"), ood),
        (f"{arm}: the written adapter's OOD ECE below LoRA + labeled TS", "ece", "ece", written,
         (arm, "no-alpha+ts"), ood),
        (f"{arm}: LoRA alone, OOD ECE below vanilla", "ece", "ece", (arm, "no-alpha"),
         ("vanilla", "alpha"), ood),
        (f"{arm}: gated α's own share, OOD ECE below LoRA alone", "ece", "ece", (arm, "alpha"),
         (arm, "no-alpha"), ood),
        (f"{arm}: the written adapter keeps OOD accuracy (vs vanilla)", "kept", "accuracy",
         written, ("vanilla", "alpha"), ood),
        (f"{arm}: in domain, the written adapter's ECE below vanilla", "ece", "ece", written,
         ("vanilla", "alpha"), [DOMAIN])]


def _round_three_lines(payload: dict) -> list[str]:
    """Each reading of the `calm train` runs out of domain (mean over seeds), and the DACA
    temperature and hold-out readings each run wrote."""
    runs = {n: r for n, r in payload["runs"].items() if r.get("arm") == SHIPPED}
    if not runs:
        return []
    vanilla = payload["runs"].get("vanilla")
    lines = ["", f"## `calm train` as users run it ({SHIPPED}: every default)", "",
             "Out of domain, per set: mean over the seeds of each reading (ECE, 10 equal-width "
             "bins; accuracy; NLL). The claims above give the paired intervals.", "",
             "| reading | seeds | " + " | ".join(f"{s} acc / ECE / NLL" for s in OOD) + " |",
             "|---|---|" + "---|" * len(OOD)]
    for arm, variant, label in ROUND3_READINGS:
        found = [vanilla] if arm == "vanilla" and vanilla else \
            [r for r in runs.values() if variant in next(iter(r["sets"].values()))]
        if not found:
            continue
        cells = []
        for set_name in OOD:
            rows = [r["sets"][set_name][variant] for r in found]
            cells.append(" / ".join(format(float(np.mean([x[k] for x in rows])), ".3f")
                                    for k in ("accuracy", "ece", "nll")))
        lines.append(f"| {label} | {len(found)} | " + " | ".join(cells) + " |")
    lines += ["", "What each run wrote (the DACA temperature against the model before the LoRA, "
              "fitted on the 150 unlabeled calibration questions; the α gate; the parts on the "
              "held-out training questions, accuracy / ECE / NLL):", "",
              "| run | α written | answer T | head T | agreement | base | LoRA | LoRA + α | "
              "LoRA + α + T |", "|---|---|---|---|---|---|---|---|---|"]
    for name, run in sorted(runs.items()):
        daca_fit = run.get("daca") or {}
        parts = (run.get("holdout_parts") or {}).get("parts", {})

        def part(key, parts=parts):
            p = parts.get(key)
            return "-" if not p else f"{p['accuracy']:.3f} / {p['ece']:.3f} / {p['nll']:.3f}"
        fit = daca_fit.get("fit") or {}
        answer_t, head_t = daca_fit.get("answer_temperature"), daca_fit.get("temperature")
        lines.append(
            f"| {name} | {'yes' if (run.get('alpha_gate') or {}).get('kept') else 'no'} | "
            f"{'-' if answer_t is None else format(answer_t, '.3f')} | "
            f"{'-' if head_t is None else format(head_t, '.3f')} | "
            f"{'-' if fit.get('agreement_rate') is None else format(fit['agreement_rate'], '.3f')}"
            f" | {part('base')} | {part('lora')} | {part('lora+alpha')} | "
            f"{part('lora+alpha+T')} |")
    return lines


# ---------------------------------------------------------------------------- report
def load_parts(args) -> dict:
    """Every part by name; the gate's own pieces (``gate-*``) are read through ``gate``."""
    folder = Path(args.parts)
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))
            if not p.stem.startswith("gate-")}


def report(args) -> int:
    parts = load_parts(args)
    gate, chosen = parts.pop("gate", None), parts.pop("default", None)
    if gate is None:
        print(f"no gate results in {args.parts}; run the plan first", file=sys.stderr)
        return 1
    default = chosen["arm"] if chosen else None
    diverged = {name: part["diverged"] for name, part in parts.items() if "diverged" in part}
    parts = {name: part for name, part in parts.items() if "diverged" not in part}
    results = claims(parts, default, args.decision_bootstrap, args.bins)
    runs = {}
    for name, part in parts.items():
        for info in part["sets"].values():  # the summaries with today's interval (summary())
            for reading in info["variants"].values():
                reading["summary"] = summary(reading["questions"], info["k"], args.bins,
                                             args.bootstrap)
        runs[name] = {k: v for k, v in part.items() if k not in ("sets", "curve")}
        eta = (part.get("settings") or {}).get("eta")
        lams = [r["lam"] for r in part.get("curve") or [] if r.get("lam") is not None]
        if eta is not None and lams:  # how far λ moved from η (the recorded curve's steps)
            runs[name]["lambda_minus_eta"] = float(np.median(np.abs(np.asarray(lams) - eta)))
        runs[name]["sets"] = {s: {v: d["summary"] for v, d in info["variants"].items()}
                              for s, info in part["sets"].items()}
    commits = ",".join(dict.fromkeys(p["commit"] for p in [gate, *parts.values()]))
    folder = Path(args.parts)
    letter_gates = {p.stem.removeprefix("gate-letter").lstrip("-") or "gate":
                    json.loads(p.read_text()) for p in sorted(folder.glob("gate-letter*.json"))}
    payload = {"command": args.command, "run_commands": sorted({p["command"] for p in
                                                                 [gate, *parts.values()]}),
               "commit": commits, "gate": gate, "letter_gates": letter_gates,
               "cft_lr": read_part(args, "gate-cft-lr"),
               "default": chosen, "claims": results,
               "runs": runs, "diverged": diverged,
               "planned": [f"{a}:{s}" for a, s in plan(default)],
               "decision_rule": __doc__.split("**The decision rule**, fixed before the runs.")[1]
               .split("Writes")[0].strip()}
    out = Path(args.out)
    (out / "calm_decisive.json").write_text(
        portable(json.dumps(payload, indent=1, default=str)) + "\n")
    (out / "calm_decisive.md").write_text(render(payload) + "\n")
    if args.readme:
        rewrite_generated_block(args.readme, README_START, README_END, readme_block(payload))
    print(render(payload))
    return 0


#: how the first round's entropy gate is read: it cannot see a reordering of the options
ENTROPY_GATE_WORDS = {True: "α moved the option entropy",
                      False: "α moved the option entropy by less than the gate asks (a "
                             "measure that does not see a reordering)"}
README_START = "<!-- generated by benchmarks/calm_decisive.py --report: start -->"
README_END = "<!-- generated by benchmarks/calm_decisive.py --report: end -->"


def _claim_line(c: dict) -> str:
    if c["verdict"] == "not run":
        why = c.get("why") or "a run it needs is not in the results yet"
        return f"| {c['claim']} | **not run** | - | {why} |"
    if c["verdict"].startswith("n/a"):
        return (f"| {c['claim']} | **{c['verdict']}** | - | {c['arm']} and {c['comparator']} "
                f"are the same readings (seeds {c['seeds'][0]} vs {c['seeds'][1]}, n={c['n']}) |")
    said = f"**{c['verdict']}**"
    if c["metric"] == "accuracy" and c["verdict"] == "holds" and c["ci"][1] < 0:
        said += " (a loss, within the 3-point margin)"
    detects = f", detects ±{c['detects']:.3f}" if c.get("detects") else ""
    return (f"| {c['claim']} | {said} | {c['delta']:+.3f} "
            f"[{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}]{detects} | {c['arm']} − {c['comparator']}, "
            f"{c['metric']}, {'+'.join(c['sets'])}, seeds {c['seeds'][0]} vs {c['seeds'][1]}, "
            f"n={c['n']} |")


def _gate_lines(gate: dict) -> list[str]:
    letter = gate["letter"]
    lines = [f"- Letter mode after LoRA: accuracy {letter['accuracy']:.3f} on {letter['n']} "
             f"validation questions, one-sided binomial p = {letter['p_value']:.3g} against "
             f"chance: the regime is **{gate['mode']}** (α tokens: {gate['alpha_tokens']}).",
             f"- α probes (warm start + {gate['probe_steps']} BOME steps; base model + learned α, "
             f"mean option entropy on the validation split, base {gate['base_entropy']:.4f} "
             f"nats; gate {gate['entropy_gate']} nats):"]
    for p in gate["probes"]:
        if "diverged" in p:
            lines.append(f"  - α lr {p['alpha_lr']:g}: diverged ({p['diverged']})")
            continue
        lines.append(f"  - α lr {p['alpha_lr']:g}: entropy change {p['entropy_change']:+.4f}, "
                     f"τ ∈ [{p['tau_range'][0]:.3f}, {p['tau_range'][1]:.3f}], "
                     f"l ∈ [{p['shift_range'][0]:.4f}, {p['shift_range'][1]:.4f}]")
    lines.append(f"- α {'moves' if gate['alpha_moves'] else 'stays inert (no probe passed)'}; "
                 f"α learning rate used: {gate['alpha_lr']:g}.")
    return lines


def _letter_gate_lines(payload: dict) -> list[str]:
    """The letter regime on each packaged model tried (the paper's class-wise α is the letter
    regime): accuracy, the binomial test, and which letters the LoRA answered; a pass would
    add letter-mode arms on that model."""
    lines = []
    for name, g in (payload.get("letter_gates") or {}).items():
        model = g.get("model", name)
        verdict = ("above chance: letter-mode CALM arms on it are the next runs"
                   if g["p_value"] < 0.05 else "not above chance: no letter regime for it")
        if g.get("tuned") and g["p_value"] < 0.05:  # a second attempt on the same model
            verdict = ("above chance by the gate's test, though not once corrected for the "
                       "two attempts on this model (p < 0.025): the letter regime is not "
                       "ruled out; no letter-mode arm was run")
        how = (f"the tuned attempt ({g['settings']['steps']} steps at rate "
               f"{g['settings']['outer_lr']:g})" if g.get("tuned") else
               f"a {g['settings']['steps']}-step LoRA at rate {g['settings']['outer_lr']:g}")
        letters = ""
        if g.get("predicted_letters"):
            def hist(counts):
                return ", ".join(f"{chr(65 + i)} {c}" for i, c in enumerate(counts))
            letters = (f"; letters answered: {hist(g['predicted_letters'])} (right letters: "
                       f"{hist(g['label_letters'])})")
        flag = "--letter-tuned " if g.get("tuned") else ""
        lines.append(f"- Letter mode after {how} on {model}: accuracy {g['accuracy']:.3f} on "
                     f"{g['n']} validation questions, one-sided binomial p = "
                     f"{g['p_value']:.3g}{letters}: {verdict} "
                     f"(`--letter-gate {model} {flag}`).".replace(" `)", "`)"))
    return lines


def _cft_lr_lines(payload: dict) -> list[str]:
    """CFT's learning rate chosen on the validation split, and whether its runs used it."""
    chosen = payload.get("cft_lr")
    if not chosen:
        return []
    lines = []
    for arm, c in chosen["arms"].items():
        grid = ", ".join(f"{lr}: {nll:.4f}" if nll is not None else f"{lr}: diverged"
                         for lr, nll in c["validation_nll"].items())
        used = sorted({r["settings"].get("outer_lr") for name, r in payload["runs"].items()
                       if name.startswith(f"{arm}-s")}, key=str)
        state = ("no runs yet." if not used else "its runs use it." if used == [c["outer_lr"]]
                 else f"its runs used {', '.join(map(str, used))}: they are to be rerun at "
                      "the chosen rate.")
        lines.append(f"- {arm}: validation NLL by learning rate ({grid}); chosen "
                     f"{c['outer_lr']:g}; {state}")
    return lines


def _cft_lines(runs: dict) -> list[str]:
    """What each CFT run trained against and how large its two loss terms were at the end."""
    rows = [(name, run) for name, run in runs.items() if run.get("cft_bins")]
    if not rows:
        return []
    lines = ["", "## CFT runs", "",
             "Bins estimated before training on the training split (accuracy/size per "
             "equal-width confidence bin, empty bins left out), and the last step's "
             "cross-entropy and L_cal with their weighted shares of the loss, "
             "(1 − w)·CE and w·c·L_cal.", "",
             "| run | w | c | bins (acc/size) | CE last | L_cal last | (1 − w)·CE | w·c·L_cal |",
             "|---|---|---|---|---|---|---|---|"]
    for name, run in rows:
        w, c = run["settings"]["cft_weight"], run["settings"]["cft_scale"]
        b, last = run["cft_bins"], run.get("last") or {}
        bins = ", ".join(f"{k / len(b['count']):.1f}: {a:.2f}/{n}" for k, (a, n) in
                         enumerate(zip(b["accuracy"], b["count"], strict=True)) if n)
        ce, cal = last.get("cft_ce"), last.get("cft_l_cal")
        lines.append(f"| {name} | {w:g} | {c:g} | {bins} | {ce:.4g} | {cal:.4g} | "
                     f"{(1 - w) * ce:.4g} | {w * c * cal:.3g} |" if ce is not None else
                     f"| {name} | {w:g} | {c:g} | {bins} | - | - | - | - |")
    return lines


def _round_two_lines(runs: dict) -> list[str]:
    """The α gate's measures (held-out training questions) and the coupling diagnostics."""
    rows = [(name, run) for name, run in runs.items() if run.get("alpha_gate")]
    if not rows:
        return []
    lines = ["", "## The α gate and the coupling", "",
             "The gate: the trained θ on held-out training questions with α as trained against "
             "without α (second-round runs: α kept if the NLL drops; `calm-train` runs: only "
             "if it drops by more than its paired 95% interval's half-width and accuracy falls "
             "by at most 0.03). The coupling: share of BOME steps with λ > η (λ > η exactly "
             "when cos(∇f, ∇q) < 0, λ < η when it is > 0: at cos ≈ 0 this share is a coin "
             "flip), median |λ − η| over the recorded curve, median ‖∇_α q‖/‖∇_α f‖ and "
             "median ‖θ~ − θ‖/‖θ‖.", "",
             "| run | α written | held-out n | NLL without → with α | answers changed | TV | "
             "KL | ΔH | λ > η | median abs(λ − η) | ‖∇_α q‖/‖∇_α f‖ | inner move |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, run in rows:
        gate, c = run["alpha_gate"], run.get("coupling") or {}
        share = gate.get("share") or {}

        def num(v, fmt=".3g"):
            return "-" if v is None else format(v, fmt)
        lines.append(
            f"| {name} | {'yes' if gate['kept'] else 'no (identity)'} | {num(share.get('n'))} | "
            f"{num(share.get('nll_without'), '.4f')} → {num(share.get('nll_alpha'), '.4f')} | "
            f"{num(share.get('flips'))} | {num(share.get('total_variation'), '.4f')} | "
            f"{num(share.get('kl_without_to_alpha'), '.4f')} | "
            f"{num(share.get('entropy_change'), '+.4f')} | "
            f"{num(c.get('share_lambda_above_eta'), '.2f')} | "
            f"{num(run.get('lambda_minus_eta'), '.2g')} | "
            f"{num(c.get('median_alpha_q_to_f'))} | {num(c.get('median_inner_move'))} |")
    return lines


#: what the claims' intervals are and are not (printed above the claims)
MULTIPLICITY = ("Each verdict rests on its own 95% interval; the claims are not corrected for "
                "multiplicity (with this many, a few verdicts at the edge of their margin may "
                "be chance): read them as exploratory, the `calm-train` rows as the measurement "
                "of what `calm train` ships. An ECE claim 'holds' only when its interval lies "
                "below 0 and outside ±0.01; 'n/a' marks two identical readings (nothing to "
                "compare).")


def render(payload: dict) -> str:
    gate, default = payload["gate"], payload["default"]
    done = set(payload["runs"])
    done |= set(payload.get("diverged", {}))
    missing = [r for r in payload["planned"]
               if (r.split(":")[0] if r.startswith("vanilla") else
                   "{}-s{}".format(*r.split(":"))) not in done]
    lines = [f"Generated by `{payload['command']}` from the runs of "
             f"{'; '.join(f'`{c}`' for c in payload['run_commands'])} at {payload['commit']}.",
             "", "## The gate", "", *_gate_lines(gate), *_letter_gate_lines(payload),
             *_cft_lr_lines(payload), "",
             "## Default arm", "",
             (f"**{default['arm']}** ({default['rule']}; NLL "
              + ", ".join(f"{a} {v:.4f}" for a, v in default["validation_nll"].items()) + ")"
              if default else "not chosen yet (its seed-0 candidates are missing)"), "",
             "## Claims", "", MULTIPLICITY, "",
             "| claim | verdict | Δ [95% percentile bootstrap CI] | what |", "|---|---|---|---|",
             *[_claim_line(c) for c in payload["claims"]], "",
             f"Runs not yet made: {', '.join(missing) if missing else 'none'}.", "",
             *[f"Diverged (no results; its verdicts are not run): {name}: {why}" for name, why
               in payload.get("diverged", {}).items()], "",
             "## Runs", "",
             "| run | set | variant | acc | ECE [95% CI] | NLL | Brier | mean conf | τ range |"
             " base+α ΔH | λ last | cos(∇f,∇q) last |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, run in payload["runs"].items():
        last = run.get("last") or {}
        tau = run.get("tau_range")
        tau_text = f"[{tau[0]:.3f}, {tau[1]:.3f}]" if tau else "-"
        dh = run.get("base_alpha_entropy_change")
        for set_name, variants in run["sets"].items():
            for variant, s in variants.items():
                chance = " *" if s["near_chance"] else ""

                def num(v, fmt=".3g"):
                    return "-" if v is None else format(v, fmt)
                lines.append(
                    f"| {name} | {set_name} | {variant} | {s['accuracy']:.3f}{chance} | "
                    f"{s['ece']:.3f} [{s['ece_ci'][0]:.3f}, {s['ece_ci'][1]:.3f}] | "
                    f"{s['nll']:.3f} | {s['brier']:.3f} | {s['mean_confidence']:.3f} | "
                    f"{tau_text} | {num(dh, '+.4f')} | {num(last.get('lam'))} | "
                    f"{num(last.get('cos_f_q'))} |")
    lines += _cft_lines(payload["runs"])
    lines += _round_two_lines(payload["runs"])
    lines += _round_three_lines(payload)
    lines += ["", "`*`: accuracy within 5 points of chance (1/K); left out of the decisions.",
              "", "## Decision rule (fixed before the runs)", "", payload["decision_rule"]]
    return "\n".join(lines)


def _seeds_per_arm(runs: dict) -> str:
    counts: dict[str, int] = {}
    for run in runs.values():
        if run.get("arm") and run["arm"] != "vanilla":
            counts[run["arm"]] = counts.get(run["arm"], 0) + 1
    return ", ".join(f"{arm} {n}" for arm, n in sorted(counts.items()))


def readme_block(payload: dict) -> str:
    gate, default = payload["gate"], payload["default"]
    lines = [f"Generated by `python benchmarks/calm_decisive.py --report` from "
             f"`benchmarks/results/calm_decisive.json` (commit {payload['commit']}): "
             f"SmolLM2-135M-Instruct trained on SciQ, out of domain ARC-Easy and PIQA, "
             f"{gate['mode']} mode. Default arm (the first round's BOME arm chosen on the "
             f"validation split; not `calm train`'s defaults, which are the `{SHIPPED}` arm): "
             f"**{default['arm'] if default else 'not chosen yet'}**. "
             f"{ENTROPY_GATE_WORDS[bool(gate['alpha_moves'])]} in the gate (α learning rate "
             f"{gate['alpha_lr']:g}). Seeds per arm: {_seeds_per_arm(payload['runs'])}.", "",
             MULTIPLICITY, "",
             "| claim | verdict | Δ [95% percentile bootstrap CI] | what |", "|---|---|---|---|",
             *[_claim_line(c) for c in payload["claims"]], *_round_three_lines(payload)]
    return "\n".join(lines)


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
