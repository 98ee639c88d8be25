"""Does CALM keep its accuracy? The deciding experiment, arm by arm, on a real model.

    python benchmarks/calm_replication.py --direction arc-easy     # train + evaluate one
    python benchmarks/calm_replication.py --direction sciq
    python benchmarks/calm_replication.py --report                 # merge both into the table
    python benchmarks/calm_replication.py --direction arc-easy --smoke   # 3 steps, 16 questions

Model: SmolLM2-135M-Instruct. A *direction* trains on one set and evaluates in domain on that
set's test part and out of domain on the others: ``arc-easy`` (out of domain: SciQ,
ARC-Challenge, MMLU) and ``sciq`` (out of domain: ARC-Easy, ARC-Challenge, MMLU). Training
data: ``DIR:train`` (labeled, CE) and ``DIR:unlabeled`` (calibration set, no labels), the two
halves of DIR's 30% calibration part; test parts are never trained on. Nothing selects
checkpoints: every arm is read after its last step. η of the SGD arms is chosen on the
training split (``--eta-grid``): a short warm-started probe per value, keeping the η with
the lowest option NLL on ``DIR:train`` (labels of the training split only). The learning
rate of the plain-SGD arm is chosen the same way (``--plain-lr-grid``, at the chosen η).

Arms, all with the same step budget (``--steps``; a warm start counts against it):

* ``lora`` — plain LoRA fine-tuning (Adam), no α;
* ``calm-adam-vocab`` — CALM as it was first built: Adam, full-vocabulary entropy at the
  answer position, θ and α both moved by f, no warm start;
* ``calm-sgd-vocab`` — SGD with momentum 0.9 (heavy ball), warm start, η from the probe;
* ``calm-sgd-options`` — the same with the entropy of the K-option distribution;
* ``calm-sgd-options-alpha`` — and f's gradient on α only (θ moves through λ∇q);
* ``calm-sgd-options-alpha-tok`` — and α only on the option tokens, with an L2 penalty;
* ``calm-adam-options-alpha`` — the options entropy with f on α only, warm start, but Adam
  (not BOME's step: a combination the SGD arms suggest);
* ``calm-bome-options-alpha`` — BOME's own step: plain SGD without momentum
  (``u ← u − lr·d``, the update whose first-order decrease of q λ guarantees; momentum
  carries earlier directions into the step and voids it), options entropy, f on α only,
  warm start, η and the learning rate probed on the training split.

The arms eligible as the BOME-faithful default are the momentum-free SGD ones
(:data:`FAITHFUL`).

Evaluation (cloze, per-token mean scores, questions with four options, ``--eval-limit``
test questions per set): every arm with and without its α, the base model with the arm's
α, and each arm (and the base model) with labeled temperature scaling fitted in domain on
``DIR``'s calibration half that no arm trained on with labels (the ``unlabeled`` half,
with its labels) and carried over to every set. ECE with a 95% bootstrap interval (10
bins), mean confidence, accuracy, a flag when accuracy is within 5 points of chance, and
the full-vocabulary entropy at the answer position.

Writes ``OUT/calm_replication.parts/DIR.json`` per direction; ``--report`` merges them into
``OUT/calm_replication.json`` and ``.md`` (and, where ``--readme`` has this script's markers,
a generated table there). Adapters go to ``--adapters``; present ones are reused (``--retrain``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
from _common import git_commit, rewrite_generated_block

from calm_runtime.cli.common import install_named
from calm_runtime.data.sets import load_dataset, split_records
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_runtime.measure import metrics
from calm_runtime.temperature import fit_temperature_scaling
from calm_training.fit import option_probabilities
from calm_training.methods import calm as calm_train
from calm_training.methods.calm import CalmConfig, train_calm

HERE = Path(__file__).resolve().parent
SETS = ("arc-easy", "sciq", "arc-challenge", "mmlu")
K = 4
VARIANT = "mean"
logger = logging.getLogger("calm_replication")

#: settings shared by every arm (the plain LoRA recipe of the project's earlier CALM run).
#: Every setting is pinned here, at the value the recorded runs used, so that a later change
#: of a CalmConfig default cannot change an arm silently (tests/benchmarks/test_arms_pinned.py
#: checks them against benchmarks/results/calm_replication.json)
COMMON = {"batch_size": 8, "calibration_batch_size": 8, "lora_rank": 8, "lora_alpha": 16.0,
          "max_length": 256, "inner_steps": 2, "inner_lr": 0.01, "cloze_variant": VARIANT,
          "mode": "cloze", "phi": "grad", "warm_start_lr": 1e-3, "q_window": 10, "beta": 1.0,
          "alpha_l2": 0.0, "upper_params": "all", "alpha_tokens": "all", "momentum": 0.9,
          "freeze_alpha": False, "cft_weight": 0.5, "cft_scale": 1e-3, "cft_bins": 10,
          # settings added later, at the behaviour these runs had (calm.config.LEGACY_SETTINGS)
          "inner_optimizer": "sgd", "alpha_logits": "raw", "upper": "entropy",
          "reference": None, "holdout": 0.0, "daca": False}
SGD = {"method": "bilevel", "optimizer": "sgd", "momentum": 0.9, "outer_lr": 0.1,
       "alpha_lr": 0.02, "calibration_positions": "answer"}
ARMS = {
    "lora": {"method": "lora", "optimizer": "adam", "outer_lr": 1e-3, "alpha_lr": None,
             "entropy": "vocab", "calibration_positions": "options"},
    "calm-adam-vocab": {"method": "bilevel", "optimizer": "adam", "outer_lr": 1e-3,
                        "alpha_lr": 5e-3, "entropy": "vocab", "calibration_positions": "answer",
                        "upper_params": "all"},
    "calm-sgd-vocab": {**SGD, "entropy": "vocab", "upper_params": "all"},
    "calm-sgd-options": {**SGD, "entropy": "options", "upper_params": "all"},
    "calm-sgd-options-alpha": {**SGD, "entropy": "options", "upper_params": "alpha"},
    "calm-sgd-options-alpha-tok": {**SGD, "entropy": "options", "upper_params": "alpha",
                                   "alpha_tokens": "options", "alpha_l2": 1e-3},
    "calm-adam-options-alpha": {"method": "bilevel", "optimizer": "adam", "outer_lr": 1e-3,
                                "alpha_lr": 5e-3, "entropy": "options", "upper_params": "alpha",
                                "calibration_positions": "answer"},
    "calm-bome-options-alpha": {**SGD, "momentum": 0.0, "entropy": "options",
                                "upper_params": "alpha"},
}
WARM = ("calm-sgd-vocab", "calm-sgd-options", "calm-sgd-options-alpha",
        "calm-sgd-options-alpha-tok", "calm-adam-options-alpha", "calm-bome-options-alpha")
#: arms whose learning rate is probed on the training split (``--plain-lr-grid``); α's
#: learning rate keeps the ratio of the SGD defaults (0.02 / 0.1)
PROBE_LR = ("calm-bome-options-alpha",)
ALPHA_LR_RATIO = SGD["alpha_lr"] / SGD["outer_lr"]
#: BOME's step: plain SGD, no momentum
FAITHFUL = tuple(a for a, s in ARMS.items() if s.get("optimizer") == "sgd"
                 and s.get("momentum", 0.9) == 0)


def _config(args, direction: str, arm: str, **extra) -> CalmConfig:
    settings = {**COMMON, **ARMS[arm], "steps": args.steps, **extra}
    if arm not in WARM:
        settings.setdefault("warm_start_steps", 0)
    else:
        settings.setdefault("warm_start_steps", args.warm_start_steps)
        if "eta" not in settings:
            settings["eta"] = args.eta
    if arm in PROBE_LR and "outer_lr" not in extra and getattr(args, "plain_lr", None):
        settings["outer_lr"] = args.plain_lr[arm]
        settings["alpha_lr"] = args.plain_lr[arm] * ALPHA_LR_RATIO
    return CalmConfig(model=args.model, train=(f"{direction}:train",),
                      calibration=(f"{direction}:unlabeled",), seed=args.seed, **settings)


def _four(records):
    return [r for r in records if len(r.choices) == K]


def _labeled_unlabeled_half(name: str):
    """``NAME:unlabeled`` with its labels (the TS fit set; no arm trained on its labels)."""
    return split_records(load_dataset(f"{name}:calibration"), calm_train.TRAIN_SPLIT_FRACTION,
                         calm_train.TRAIN_SPLIT_SEED)[1]


def _evaluator(args):
    from calm_training.methods.calm import CalmModel, OptionEvaluator

    config = CalmConfig(model=args.model, train=("-",), calibration=("-",), method="bilevel",
                        lora_rank=COMMON["lora_rank"], lora_alpha=COMMON["lora_alpha"])
    model = CalmModel(config, _device())
    return OptionEvaluator(model, mode="cloze", variant=VARIANT,
                           max_length=COMMON["max_length"], batch_size=args.eval_batch_size)


def _device():
    import torch

    return torch.device("cpu")


def _probe(args, direction: str, arm: str, **settings) -> dict:
    """Train ``arm`` for the warm start + ``--probe-steps`` bilevel steps with ``settings``;
    its option NLL on ``DIR:train`` (labels of the training split only) and its last q."""
    from calm_training.methods.calm import OptionEvaluator

    train = _four(calm_train.resolve_records(f"{direction}:train"))
    config = _config(args, direction, arm, steps=args.warm_start_steps + args.probe_steps,
                     **settings)
    result = train_calm(config, None, progress=False)
    tau, shift = result.model.tau_shift()
    evaluator = OptionEvaluator(result.model, mode="cloze", variant=VARIANT,
                                max_length=COMMON["max_length"], batch_size=args.eval_batch_size)
    hidden = evaluator.hidden(train)
    scores, _ = evaluator.scores(hidden, tau, shift)
    nll = metrics.nll(option_probabilities(scores), hidden.labels)
    logger.info("probe %s %s: option NLL on %s:train %.4f", arm, settings, direction, nll)
    return {"train_option_nll": nll, "q_last": result.history[-1]["q"]}


def choose_eta(args, direction: str) -> dict:
    """η of the SGD arms: the probe (warm start + ``--probe-steps`` bilevel steps) whose
    option NLL on ``DIR:train`` is lowest."""
    if len(args.eta_grid) == 1:
        return {"eta": args.eta_grid[0], "probe": []}
    probe = [{"eta": eta, **_probe(args, direction, "calm-sgd-vocab", eta=eta)}
             for eta in args.eta_grid]
    best = min(probe, key=lambda r: r["train_option_nll"])
    return {"eta": best["eta"], "probe": probe}


def choose_lr(args, direction: str, arm: str) -> dict:
    """The learning rate of a plain-SGD arm (:data:`PROBE_LR`), probed like η, at the chosen
    η: the value of ``--plain-lr-grid`` with the lowest option NLL on ``DIR:train``."""
    if len(args.plain_lr_grid) == 1:
        return {"lr": args.plain_lr_grid[0], "probe": []}
    probe = [{"lr": lr, **_probe(args, direction, arm, outer_lr=lr,
                                 alpha_lr=lr * ALPHA_LR_RATIO)}
             for lr in args.plain_lr_grid]
    best = min(probe, key=lambda r: r["train_option_nll"])
    return {"lr": best["lr"], "probe": probe}


def train_arms(args, direction: str) -> dict:
    runs = {}
    for arm in args.arms:
        out = Path(args.adapters) / direction / arm
        if out.is_dir() and not args.retrain:
            adapter = CalibrationAdapter.from_pretrained(out)
            training = adapter.metrics.get("training", {})
            logger.info("reusing %s", out)
        else:
            result = train_calm(_config(args, direction, arm), out, overwrite=True,
                                progress=not args.quiet)
            training = result.adapter.metrics["training"]
        runs[arm] = {"dir": str(out), "seconds": training.get("seconds"),
                     "steps": training.get("steps"), "last": training.get("last"),
                     "q_growth_warnings": training.get("q_growth_warnings"),
                     "settings": CalibrationAdapter.from_pretrained(out).method["settings"]}
        logger.info("%s/%s: %s steps in %s s", direction, arm, runs[arm]["steps"],
                    runs[arm]["seconds"])
    return runs


def _row(direction, method, eval_set, with_alpha, probs, labels, entropy, args) -> dict:
    conf = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == labels).astype(float)
    acc = float(correct.mean())
    lo, hi = metrics.bootstrap_interval(lambda c, k: metrics.ece(c, k, args.bins), conf,
                                        correct, n_resamples=args.bootstrap)
    return {"direction": direction, "method": method, "eval_set": eval_set,
            "in_domain": eval_set == direction, "with_alpha": with_alpha, "accuracy": acc,
            "ece": float(metrics.ece(conf, correct, args.bins)), "ece_ci": [lo, hi],
            "mean_confidence": float(conf.mean()), "near_chance": acc < 1.0 / K + 0.05,
            "answer_vocab_entropy": None if entropy is None else float(np.mean(entropy)),
            "n": int(labels.size)}


def evaluate(args, direction: str, runs: dict, evaluator, vanilla: bool = True) -> list[dict]:
    sets = {name: _four(load_dataset(f"{name}:test"))[:args.eval_limit] for name in SETS}
    ts_set = _four(_labeled_unlabeled_half(direction))
    rows = []
    states = [("vanilla", None)] * vanilla + [(arm, run) for arm, run in runs.items()]
    for arm, run in states:
        if run is None:
            evaluator.reset_lora()
            alphas = {True: (None, None)}
        else:
            adapter = CalibrationAdapter.from_pretrained(run["dir"])
            evaluator.model.load_lora(adapter.lora_path)
            alphas = {True: (adapter.tau, adapter.shift)}
            if arm != "lora":
                alphas[False] = (None, None)
        hidden_ts = evaluator.hidden(ts_set)
        fits = {}
        for with_alpha, (tau, shift) in alphas.items():
            s, _ = evaluator.scores(hidden_ts, tau, shift)
            fits[with_alpha] = fit_temperature_scaling(s, hidden_ts.labels).temperature
        for name, records in sets.items():
            hidden = evaluator.hidden(records, progress=not args.quiet)
            for with_alpha, (tau, shift) in alphas.items():
                scores, entropy = evaluator.scores(hidden, tau, shift)
                label = arm if with_alpha or arm == "vanilla" else f"{arm}/no-alpha"
                rows.append(_row(direction, label, name, with_alpha or arm == "lora",
                                 option_probabilities(scores), hidden.labels, entropy, args))
                t = fits[with_alpha]
                ts_row = _row(direction, f"{label}+ts", name, with_alpha or arm == "lora",
                              option_probabilities(scores, t), hidden.labels, None, args)
                ts_row["temperature"] = t
                rows.append(ts_row)
        logger.info("%s/%s evaluated", direction, arm)
    # the base model with each arm's α (the α alone, without its LoRA)
    evaluator.reset_lora()
    hidden_sets = {name: evaluator.hidden(records) for name, records in sets.items()}
    for arm, run in runs.items():
        if arm == "lora":
            continue
        adapter = CalibrationAdapter.from_pretrained(run["dir"])
        for name, hidden in hidden_sets.items():
            scores, entropy = evaluator.scores(hidden, adapter.tau, adapter.shift)
            rows.append(_row(direction, f"base+alpha-of-{arm}", name, True,
                             option_probabilities(scores), hidden.labels, entropy, args))
    return rows


def run_direction(args) -> int:
    direction = args.direction
    started = time.perf_counter()
    commit = git_commit()  # the code that runs (later commits do not change this process)
    folder = Path(args.out) / ("calm_replication_smoke.parts" if args.smoke
                               else "calm_replication.parts")
    path = folder / f"{direction}.json"
    previous = None
    if args.add:
        if not path.is_file():
            raise SystemExit(f"--add: no earlier results in {path}; run the direction without "
                             "--add first")
        previous = json.loads(path.read_text())
        chosen = previous["eta"]  # the arms added share the direction's probed η
    else:
        chosen = choose_eta(args, direction)
    args.eta = chosen["eta"]
    lr_probes = {arm: choose_lr(args, direction, arm) for arm in args.arms if arm in PROBE_LR}
    args.plain_lr = {arm: probe["lr"] for arm, probe in lr_probes.items()}
    runs = train_arms(args, direction)
    rows = evaluate(args, direction, runs, _evaluator(args), vanilla=previous is None)
    part = {"command": args.command, "commit": commit, "direction": direction,
            "eta": chosen, "lr_probes": lr_probes, "runs": runs, "rows": rows,
            "wall_s": round(time.perf_counter() - started, 1),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "settings": {k: v for k, v in vars(args).items() if k != "command"}}
    if previous is not None:
        part = merge_parts(previous, part)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(part, indent=1, default=str) + "\n")
    tmp.replace(path)
    logger.warning("wrote %s", path)
    return 0


def _arm_of(method: str) -> str:
    """The arm a row belongs to (``vanilla`` for the base model's own rows)."""
    name = method.removeprefix("base+alpha-of-").split("/")[0].split("+")[0]
    return name


def merge_parts(previous: dict, added: dict) -> dict:
    """``previous`` with the arms of ``added`` (an ``--add`` run) replacing or joining its own:
    runs, rows and learning-rate probes; commands, commits and wall times of both runs kept
    (joined with `` && `` and ``,``)."""
    arms = set(added["runs"])
    rows = [r for r in previous["rows"] if _arm_of(r["method"]) not in arms] + added["rows"]
    runs = {a: r for a, r in previous["runs"].items() if a not in arms} | added["runs"]
    commits = list(dict.fromkeys(previous["commit"].split(",") + [added["commit"]]))
    return {**previous, "command": previous["command"] + " && " + added["command"],
            "commit": ",".join(commits), "runs": runs, "rows": rows,
            "lr_probes": {**previous.get("lr_probes", {}), **added["lr_probes"]},
            "wall_s": round(previous["wall_s"] + added["wall_s"], 1), "date": added["date"]}


#: CALM arms not eligible as the default: the first-built arm the experiment re-examines
NOT_DEFAULT = ("calm-adam-vocab",)


def pick_default(rows: list[dict], runs: dict) -> tuple[str, str]:
    """``(arm, reason)``: the default of ``calm train``.

    Eligible: the CALM arms except :data:`NOT_DEFAULT`. First choice, a BOME-faithful arm
    (plain SGD) whose in-domain accuracy is within 2 points of plain LoRA's in every
    direction; then any arm that is; then the arm with the smallest worst gap. Ties within a
    tier go to the lowest mean in-domain ECE.
    """
    def in_domain(direction, method):
        return next(r for r in rows if r["direction"] == direction and r["method"] == method
                    and r["in_domain"])

    directions = sorted({r["direction"] for r in rows})
    arms = [a for a in runs if a != "lora" and a not in NOT_DEFAULT]
    if not arms:
        return "none", "no CALM arm was run"

    def gap(arm):
        return max(in_domain(d, "lora")["accuracy"] - in_domain(d, arm)["accuracy"]
                   for d in directions)

    def ece(arm):
        return float(np.mean([in_domain(d, arm)["ece"] for d in directions]))

    keeps = [a for a in arms if gap(a) <= 0.02]
    faithful = [a for a in keeps if a in FAITHFUL]
    if faithful:
        arm = min(faithful, key=ece)
        return arm, "the BOME-faithful arm (plain SGD, no momentum) that keeps plain LoRA's " \
            "accuracy (within 2 points in every direction) with the lowest in-domain ECE"
    if keeps:
        arm = min(keeps, key=ece)
        return arm, "no BOME-faithful arm (plain SGD, no momentum) kept plain LoRA's " \
            "accuracy; of the arms that did (within 2 points in every direction), the one " \
            "with the lowest in-domain ECE"
    arm = min(arms, key=lambda a: (gap(a), ece(a)))
    return arm, "no arm kept plain LoRA's accuracy; the one with the smallest worst " \
        "in-domain accuracy gap"


def report(args) -> int:
    folder = Path(args.out) / "calm_replication.parts"
    parts = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    if not parts:
        print(f"no direction results in {folder}; run --direction first", file=sys.stderr)
        return 1
    rows = [r for p in parts for r in p["rows"]]
    default, reason = pick_default(rows, {a: r for p in parts for a, r in p["runs"].items()
                                          if all(a in q["runs"] for q in parts)})
    payload = {"command": " && ".join(p["command"] for p in parts) + " && " + args.command,
               "commit": ",".join(dict.fromkeys(c for p in parts
                                                for c in p["commit"].split(","))),
               "default_method": default, "default_reason": reason, "rows": rows,
               "directions": {p["direction"]: {"eta": p["eta"], "wall_s": p["wall_s"],
                                               "lr_probes": p.get("lr_probes", {}),
                                               "runs": p["runs"]} for p in parts}}
    out = Path(args.out)
    (out / "calm_replication.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    (out / "calm_replication.md").write_text(render(payload) + "\n")
    if rewrite_generated_block(args.readme, README_START, README_END, readme_block(payload)):
        print(f"updated the generated block of {args.readme}")
    print(render(payload))
    return 0


README_START = "<!-- generated by benchmarks/calm_replication.py --report: start -->"
README_END = "<!-- generated by benchmarks/calm_replication.py --report: end -->"


def _pick(rows, direction, method, eval_set):
    return next((r for r in rows if r["direction"] == direction and r["method"] == method
                 and r["eval_set"] == eval_set), None)


def claims(payload: dict) -> list[str]:
    """The paper's two claims, checked per direction for the default arm, as measured."""
    rows, arm = payload["rows"], payload["default_method"]
    out = []
    for direction in payload["directions"]:
        lora, calm = _pick(rows, direction, "lora", direction), _pick(rows, direction, arm,
                                                                      direction)
        if lora is None or calm is None:
            continue
        gap = calm["accuracy"] - lora["accuracy"]
        verdict = "holds" if gap >= -0.02 else "does not hold"
        better = "below" if calm["ece"] < lora["ece"] else "not below"
        out.append(f"- trained on {direction}, keeps accuracy: {verdict} (in domain "
                   f"{calm['accuracy']:.3f} vs plain LoRA {lora['accuracy']:.3f}, "
                   f"{gap * 100:+.1f} points); ECE {calm['ece']:.3f} {better} plain LoRA's "
                   f"{lora['ece']:.3f}; answer-position entropy "
                   f"{calm['answer_vocab_entropy']:.2f} nats (LoRA "
                   f"{lora['answer_vocab_entropy']:.2f}).")
        for eval_set in SETS:
            if eval_set == direction:
                continue
            c = _pick(rows, direction, arm, eval_set)
            if c is None or _pick(rows, direction, "vanilla", eval_set)["near_chance"]:
                continue
            ts = {m: _pick(rows, direction, m, eval_set) for m in ("lora+ts", "vanilla+ts")}
            lora_ood = _pick(rows, direction, "lora", eval_set)
            verdict = "holds" if all(c["ece"] < r["ece"] for r in ts.values()) \
                else "does not hold"
            others = ", ".join(f"{m} {r['ece']:.3f}" for m, r in ts.items())
            out.append(f"- trained on {direction}, out of domain on {eval_set} (above chance): "
                       f"beats carried-over TS: {verdict} (ECE {c['ece']:.3f} "
                       f"[{c['ece_ci'][0]:.3f}, {c['ece_ci'][1]:.3f}] vs {others}; plain "
                       f"LoRA {lora_ood['ece']:.3f}; accuracy {c['accuracy']:.3f} vs LoRA "
                       f"{lora_ood['accuracy']:.3f}).")
    return out


def readme_block(payload: dict) -> str:
    rows, arm = payload["rows"], payload["default_method"]
    steps = {d: next(iter(info["runs"].values()))["steps"]
             for d, info in payload["directions"].items()}
    lines = [f"Generated by `python benchmarks/calm_replication.py --report` from "
             f"`benchmarks/results/calm_replication.json` (commit {payload['commit']}); "
             f"SmolLM2-135M-Instruct, {', '.join(f'{s} steps' for s in set(steps.values()))} "
             f"per arm, cloze mean scores, ECE with a 95% bootstrap interval (10 bins). "
             f"Default arm of `calm train`: **{arm}** ({payload.get('default_reason', '')}).",
             ""]
    for direction in payload["directions"]:
        ood = [s for s in SETS if s != direction
               and not _pick(rows, direction, "vanilla", s)["near_chance"]]
        head = "| arm | α | in-domain acc | in-domain ECE | mean conf | answer entropy |"
        rule = "|---|---|---|---|---|---|"
        for s in ood:
            head += f" {s} ECE (acc) |"
            rule += "---|"
        n = _pick(rows, direction, "vanilla", direction)["n"]
        lines += [f"Trained on {direction} (test n={n}; out-of-domain sets near chance "
                  "left out):", "", head, rule]
        methods = ["vanilla", "vanilla+ts", "lora", "lora+ts"] + [
            m for m in payload["directions"][direction]["runs"] if m != "lora"] + [f"{arm}+ts"]
        for method in methods:
            r = _pick(rows, direction, method, direction)
            if r is None:
                continue
            ent = "-" if r["answer_vocab_entropy"] is None else f"{r['answer_vocab_entropy']:.2f}"
            line = (f"| {method} | {'yes' if r['with_alpha'] else 'no'} | {r['accuracy']:.3f} | "
                    f"{r['ece']:.3f} [{r['ece_ci'][0]:.3f}, {r['ece_ci'][1]:.3f}] | "
                    f"{r['mean_confidence']:.3f} | {ent} |")
            for s in ood:
                o = _pick(rows, direction, method, s)
                line += f" {o['ece']:.3f} ({o['accuracy']:.3f}) |"
            lines.append(line)
        lines.append("")
    lines += ["The paper's two claims for the default arm, as measured:", "", *claims(payload)]
    return "\n".join(lines)


def render(payload: dict) -> str:
    lines = [f"Generated by `{payload['command']}` at {payload['commit']}.", "",
             f"Default arm chosen: **{payload['default_method']}** "
             f"({payload.get('default_reason', '')}).", ""]
    for direction, info in payload["directions"].items():
        lines += [f"## trained on {direction}", "",
                  f"η = {info['eta']['eta']} (probe: {info['eta']['probe']})", ""]
        for arm, probe in (info.get("lr_probes") or {}).items():
            lines += [f"{arm}: learning rate {probe['lr']} (probe: {probe['probe']})", ""]
        lines += [
                  "| arm | steps | train s | last f | last g | last g (α=identity) | last q |"
                  " q-growth warnings |", "|---|---|---|---|---|---|---|---|"]
        for arm, run in info["runs"].items():
            last = run.get("last") or {}

            def num(key, last=last):
                value = last.get(key)
                return "-" if value is None else f"{value:.3g}"
            lines.append(f"| {arm} | {run['steps']} | {run['seconds']:.0f} | {num('f')} | "
                         f"{num('g')} | {num('g_identity')} | {num('q')} | "
                         f"{run.get('q_growth_warnings')} |")
        lines += [""]
        for eval_set in SETS:
            sel = [r for r in payload["rows"] if r["direction"] == direction
                   and r["eval_set"] == eval_set]
            if not sel:
                continue
            where = "in domain" if sel[0]["in_domain"] else "out of domain"
            flag = " (near chance)" if any(r["near_chance"] for r in sel
                                           if r["method"] == "vanilla") else ""
            lines += [f"### {eval_set} ({where}{flag}, n={sel[0]['n']})", "",
                      "| method | α | acc | ECE [95% CI] | mean conf | answer-position entropy |",
                      "|---|---|---|---|---|---|"]
            for r in sel:
                ent = "-" if r["answer_vocab_entropy"] is None else \
                    f"{r['answer_vocab_entropy']:.2f}"
                chance = " *" if r["near_chance"] else ""
                lines.append(f"| {r['method']} | {'yes' if r['with_alpha'] else 'no'} | "
                             f"{r['accuracy']:.3f}{chance} | {r['ece']:.3f} [{r['ece_ci'][0]:.3f}, "
                             f"{r['ece_ci'][1]:.3f}] | {r['mean_confidence']:.3f} | {ent} |")
            lines += [""]
    lines += ["`*`: accuracy within 5 points of chance (0.25).", "",
              "The paper's two claims for the default arm:", "", *claims(payload)]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--direction", choices=["arc-easy", "sciq"])
    parser.add_argument("--report", action="store_true", help="merge the directions' results")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warm-start-steps", type=int, default=20)
    parser.add_argument("--eta-grid", type=float, nargs="+", default=[0.5, 2.0])
    parser.add_argument("--plain-lr-grid", type=float, nargs="+", default=[0.1, 0.5],
                        help="learning rates probed for the plain-SGD (no momentum) arm")
    parser.add_argument("--probe-steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-limit", type=int, default=150)
    parser.add_argument("--eval-batch-size", type=int, default=16)
    parser.add_argument("--bins", type=int, default=10)
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--smoke", action="store_true", help="3 steps, 16 questions per set")
    parser.add_argument("--retrain", action="store_true")
    parser.add_argument("--add", action="store_true",
                        help="train and evaluate only --arms and merge them into the "
                        "direction's earlier results (same η; vanilla rows kept)")
    parser.add_argument("--adapters", default="calm-out/calm-replication/adapters")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--readme", default=str(HERE.parent / "docs" / "results.md"),
                        help="--report rewrites this file's generated CALM block (if it has "
                        "this script's markers)")
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    args.command = "python benchmarks/calm_replication.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    if args.smoke:
        args.steps, args.warm_start_steps, args.eval_limit, args.probe_steps = 3, 1, 16, 1
        args.bootstrap = 50
        args.adapters = args.adapters.replace("calm-replication", "calm-replication-smoke")
    if not args.report and not args.direction:
        parser.error("give --direction arc-easy|sciq, or --report")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.report:
        return report(args)
    install_named([args.model], SETS)  # a command line: it may install
    return run_direction(args)


if __name__ == "__main__":
    sys.exit(main())
