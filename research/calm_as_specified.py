"""CALM as the paper states it, read out of domain where fine-tuning leaves the model
over-confident, against the plain LoRA and the LoRA with temperature scaling.

    python research/calm_as_specified.py            # every part not made yet, then the report
    python research/calm_as_specified.py --report   # the result files from the parts made
    python research/calm_as_specified.py --smoke    # 2 steps, 8 questions per set, elsewhere

Every part is a file written when it is done (a stopped run goes on where it stopped; a
training run writes checkpoints and resumes from them).

## The design, fixed before any claim is read

Model SmolLM2-135M-Instruct, cloze mode (per-token mean), LoRA rank 8, 60 steps of 8
questions, seeds 0, 1, 2, every training setting equal between the arms but the ones that
make them what they are (each method's own optimiser: Adam at 1e-3 for plain fine-tuning,
the usual recipe and `calm train --method lora`'s; plain SGD for CALM's BOME step). 60 steps
(not the default 200): CALM as specified costs about 12 s a step here, and three seeds of
both arms must fit one sitting of two cores.

* **Training data (in domain)**: the ``train`` parts of SciQ, PIQA, Social IQa and MMLU
  (labeled, 949 questions); CALM's upper level reads their ``unlabeled`` parts (answers
  removed).
* **Out-of-domain sets**: ARC-Easy, ARC-Challenge, OpenBookQA, CommonsenseQA, HellaSwag,
  COPA, Winogrande, BoolQ. Each set's ``calibration`` part gives the **selection
  questions** (at most 150, a fixed random subset), its ``test`` part the **test
  questions** (at most 300); the two are disjoint and no arm trains on either.
* **Arms**: ``vanilla`` (the model); ``lora`` (plain LoRA fine-tuning on the training
  data's cross-entropy, ``calm train --method lora``); ``lora+ts`` (the LoRA with a
  temperature fitted with labels on in-domain questions no arm trained on: the training
  sets' ``unlabeled`` parts, at most 100 each); ``calm`` (``calm train --as-specified``:
  the BOME step on θ and α, vocabulary entropy, raw logits, α and no temperature written as
  trained); ``calm-theta`` (the same run's LoRA without its α: α's own share).
  ``vanilla+ts`` is read beside them.
* **Go/no-go, on selection questions only** (``vanilla`` and ``lora``, three seeds): an
  out-of-domain set is **in the regime** when vanilla's accuracy on it is at least chance
  (the mean of 1/K) + 0.05 and the LoRA's over-confidence (mean confidence − accuracy) is at
  least +0.05 with its paired 95% interval above 0. **Go** when at least 2 sets are in the
  regime. On no-go, rung 2 trains every arm twice as many steps (120) and decides again;
  on a second no-go no claim is read.
* **Claims, on the regime's test questions pooled** (question-weighted), Δ = a − b by a
  paired basic bootstrap (seeds resampled with one index for both sides, then questions
  within each set; 2,000 resamples): ECE of ``calm`` against ``lora``, ``lora+ts`` and
  ``calm-theta`` **holds** when the interval lies below 0 and not inside ±0.01, is
  **refuted** when it lies above 0 or inside ±0.01, else **inconclusive**; ``calm``'s
  accuracy against ``lora`` is **kept** when the interval lies above −0.03. NLL and Brier
  are read beside them. Each row prints the smallest difference the design detects (80%
  power, two-sided 5%: 2.8 bootstrap standard errors). ECE: 10 equal-width bins.
* **In domain** (the training sets' ``test`` parts, at most 150 each): ``calm`` against
  ``lora``, accuracy (margin −0.03) and NLL (margin +0.02 nats), non-inferiority.
* **The default** (`calm train`'s): CALM as specified becomes it when the ECE claims
  against ``lora`` and ``lora+ts`` both hold and the accuracy is kept, out of domain and in
  domain; else the default stays and the README says what was measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from calm_runtime.data.sets import load_dataset, split_records
from calm_runtime.errors import CalmError
from calm_runtime.formats.artifact import MANIFEST_NAME, CalibrationAdapter
from calm_runtime.measure import metrics
from calm_runtime.temperature import fit_temperature_scaling
from calm_training.fit import option_probabilities
from calm_training.methods import calm as calm_train
from calm_training.methods.calm import AS_SPECIFIED, CalmConfig

HERE = Path(__file__).resolve().parent
NAME = "calm_as_specified"
logger = logging.getLogger(NAME)

MODEL = "smollm2-135m-instruct"
TRAIN_SETS = ("sciq", "piqa", "social-iqa", "mmlu")
OOD_SETS = ("arc-easy", "arc-challenge", "openbookqa", "commonsenseqa", "hellaswag", "copa",
            "winogrande", "boolq")
SEEDS = (0, 1, 2)
STEPS = 60
SELECTION_SIZE, TEST_SIZE, VALIDATION_SIZE, DOMAIN_TEST_SIZE = 150, 300, 100, 150
SUBSET_SEED = 0
#: the go/no-go rule (selection questions only)
CHANCE_MARGIN = 0.05
OVER_CONFIDENCE = 0.05
MIN_REGIME_SETS = 2
#: rung 1: STEPS steps; rung 2 (on a no-go): twice as many (more fine-tuning, more
#: over-confidence)
RUNGS = {1: {"steps": STEPS}, 2: {"steps": 2 * STEPS}}
BINS = 10
ECE_MARGIN, ACC_MARGIN, NLL_MARGIN = 0.01, 0.03, 0.02
#: 80% power at two-sided 5%: z_0.975 + z_0.8
DETECTS = 1.96 + 0.84
CLAIMS = (("ece", "calm", "lora"), ("ece", "calm", "lora+ts"), ("ece", "calm", "calm-theta"),
          ("accuracy", "calm", "lora"))
READ_BESIDE = (("nll", "calm", "lora"), ("nll", "calm", "lora+ts"),
               ("brier", "calm", "lora"), ("brier", "calm", "lora+ts"),
               ("ece", "lora+ts", "lora"), ("ece", "calm", "vanilla"))
DOMAIN_CLAIMS = (("accuracy", "calm", "lora"), ("nll", "calm", "lora"))
READINGS = {"vanilla": ("vanilla", "vanilla+ts"), "lora": ("lora", "lora+ts"),
            "calm": ("calm", "calm-theta")}


# ---------------------------------------------------------------------------- data
def subset(records: list, size: int | None) -> list:
    if size is None or len(records) <= size:
        return records
    order = list(range(len(records)))
    random.Random(SUBSET_SEED).shuffle(order)
    return [records[i] for i in sorted(order[:size])]


def question_sets(stage: str, limit: int | None, only=None) -> dict:
    """``{set: records}`` of a stage: ``selection`` / ``test`` (out of domain),
    ``validation`` (in-domain labeled questions no arm trains on) or ``domain`` (in-domain
    test questions); ``only``: these sets alone."""
    if stage in ("selection", "test"):
        part, size, names = ("calibration", SELECTION_SIZE, OOD_SETS) if stage == "selection" \
            else ("test", TEST_SIZE, OOD_SETS)
        load = {s: (lambda s=s: load_dataset(f"{s}:{part}")) for s in names}
    elif stage == "validation":
        size = VALIDATION_SIZE
        load = {s: (lambda s=s: split_records(load_dataset(f"{s}:calibration"),
                                              calm_train.TRAIN_SPLIT_FRACTION,
                                              calm_train.TRAIN_SPLIT_SEED)[1])
                for s in TRAIN_SETS}
    else:
        size = DOMAIN_TEST_SIZE
        load = {s: (lambda s=s: load_dataset(f"{s}:test")) for s in TRAIN_SETS}
    return {s: subset(fn(), size)[:limit] if limit else subset(fn(), size)
            for s, fn in load.items() if only is None or s in only}


# ---------------------------------------------------------------------------- training
def config(kind: str, seed: int, rung: int, smoke: bool) -> CalmConfig:
    """The arm ``kind`` (``lora`` or ``calm``) of one seed and rung: each method's own
    optimiser (plain fine-tuning: Adam at 1e-3, the usual recipe; CALM: plain SGD, BOME)."""
    common = {"model": MODEL, "train": tuple(f"{s}:train" for s in TRAIN_SETS),
              "calibration": tuple(f"{s}:unlabeled" for s in TRAIN_SETS), "seed": seed,
              "checkpoint_every": 20, **RUNGS[rung]}
    if smoke:
        common["steps"] = 2
    if kind == "lora":
        return CalmConfig(method="lora", holdout=0, daca=False, **common)
    return CalmConfig(method="bilevel", **AS_SPECIFIED, **common)


def trained(cfg: CalmConfig, out: Path, progress: bool) -> CalibrationAdapter:
    """The adapter in ``out`` when it was trained with ``cfg``, else trained now (resumed from
    its checkpoints where a stopped run left them)."""
    from calm_training.methods.calm import latest_checkpoint, train_calm

    settings = json.loads(json.dumps(cfg.to_dict()))
    if (out / MANIFEST_NAME).is_file():
        try:
            adapter = CalibrationAdapter.from_pretrained(out)
            if adapter.method.get("settings") == settings:
                return adapter
        except CalmError as exc:
            logger.warning("training %s again: %s", out.name, exc)
    checkpoints = out.with_name(out.name + ".checkpoints")
    resume = checkpoints.is_dir() and latest_checkpoint(checkpoints) is not None
    logger.warning("training %s (%s)", out.name, "resumed" if resume else "from the start")
    train_calm(cfg, out, resume=resume, overwrite=True, progress=progress)
    return CalibrationAdapter.from_pretrained(out)


# ---------------------------------------------------------------------------- readings
class Reader:
    """Option probabilities of the model under one LoRA and α at a time."""

    def __init__(self, batch_size: int, quiet: bool):
        import torch

        from calm_training.methods.calm import CalmModel, OptionEvaluator

        defaults = CalmConfig(model=MODEL, train=("-",), calibration=("-",))
        self.ev = OptionEvaluator(CalmModel(defaults, torch.device("cpu")), mode="cloze",
                                  variant=defaults.cloze_variant,
                                  max_length=defaults.max_length, batch_size=batch_size)
        self.quiet = quiet

    def use(self, adapter: CalibrationAdapter | None) -> None:
        if adapter is None:
            self.ev.reset_lora()
        else:
            self.ev.model.load_lora(adapter.lora_path)

    def scores(self, records, alpha=None, *, plain: bool = False):
        """``(option scores [N, K], labels)`` under α (``(tau, shift, centred)``; None: the
        identity); ``plain``: the scores ``(with α, without)`` from one forward pass."""
        hidden = self.ev.hidden(records, progress=not self.quiet)
        tau, shift, center = alpha or (None, None, False)
        scores = self.ev.scores(hidden, tau, shift, center=center)[0]
        if plain:
            scores = (scores, self.ev.scores(hidden)[0])
        return scores, hidden.labels


def padded(scores: list[np.ndarray]) -> np.ndarray:
    """The score matrices of sets with different option counts as one [N, K_max] matrix
    for the temperature fit: an absent option scores 1e4 below its row's lowest (a
    probability of exp(−1e4 / T): none at any temperature the fit reaches)."""
    k = max(x.shape[1] for x in scores)
    rows = []
    for x in scores:
        x = np.where(np.isfinite(x), x, np.nan)
        low = np.nanmin(x, axis=1, keepdims=True) - 1e4
        x = np.concatenate([x, np.full((x.shape[0], k - x.shape[1]), np.nan)], axis=1)
        rows.append(np.where(np.isnan(x), low, x))
    return np.concatenate(rows)


def probs_entry(scores: np.ndarray, labels: np.ndarray, t: float = 1.0) -> list:
    p = option_probabilities(scores, t)
    return [[round(float(x), 6) for x in row[np.isfinite(scores[i])]]
            for i, row in enumerate(p)]


def read_model(reader: Reader, kind: str, adapter, stages: dict, limit) -> dict:
    """One model's readings (``READINGS[kind]``) on the sets of ``stages``
    (``{stage: only}``): per set the labels and each reading's option probabilities; the
    TS readings with the temperature fitted on the validation questions."""
    reader.use(adapter)
    alpha = None
    if kind == "calm":
        alpha = (np.asarray(adapter.tau) * float(adapter.temperature),
                 np.asarray(adapter.shift) / float(adapter.temperature), adapter.centered)
    out = {"stages": {}}
    ts = None
    if kind in ("vanilla", "lora"):
        val = question_sets("validation", limit)
        scores, labels = zip(*(reader.scores(r) for r in val.values()), strict=True)
        ts = fit_temperature_scaling(padded(scores), np.concatenate(labels)).temperature
        out["ts_temperature"] = float(ts)
    for stage, only in stages.items():
        entry = {}
        for s, records in question_sets(stage, limit, only).items():
            names = READINGS[kind]
            if kind == "calm":
                (with_alpha, plain), labels = reader.scores(records, alpha, plain=True)
                read = {names[0]: probs_entry(with_alpha, labels),
                        names[1]: probs_entry(plain, labels)}
            else:
                scores, labels = reader.scores(records)
                read = {names[0]: probs_entry(scores, labels),
                        names[1]: probs_entry(scores, labels, ts)}
            entry[s] = {"labels": [int(x) for x in labels], "chance": float(np.mean(
                [1.0 / len(r.choices) for r in records])), "readings": read}
            logger.info("%s: read %s %s", kind, stage, s)
        out["stages"][stage] = entry
    return out


# ---------------------------------------------------------------------------- statistics
def per_question(probs: list, labels: list) -> dict:
    conf = np.array([max(p) for p in probs])
    correct = np.array([int(np.argmax(p) == y) for p, y in zip(probs, labels, strict=True)],
                       float)
    p_true = np.array([p[y] for p, y in zip(probs, labels, strict=True)])
    nll = -np.log(np.clip(p_true, metrics.PROB_EPS, 1.0))
    brier = np.array([sum((q - (i == y)) ** 2 for i, q in enumerate(p))
                      for p, y in zip(probs, labels, strict=True)])
    return {"conf": conf, "correct": correct, "nll": nll, "brier": brier}


def metric(q: dict, name: str, idx=None) -> float:
    idx = slice(None) if idx is None else idx
    conf, correct = q["conf"][idx], q["correct"][idx]
    if name == "ece":
        return float(metrics.ece(conf, correct, BINS))
    if name == "accuracy":
        return float(correct.mean())
    if name == "over_confidence":
        return float(conf.mean() - correct.mean())
    if name == "mean_confidence":
        return float(conf.mean())
    return float(q[name][idx].mean())


def paired_delta(a: list[dict], b: list[dict] | None, sets: list[str], name: str, n_boot: int,
                 seed: int = 0) -> dict:
    """Δ = metric(a) − metric(b) (``b`` None: metric(a) itself), question-weighted over
    ``sets`` (``a``/``b``: per seed, ``{set: per-question arrays}``), with its paired basic
    bootstrap interval (seeds, then questions): ``2Δ − q97.5`` to ``2Δ − q2.5`` (a verdict
    that does not improve as the resampling gets less precise)."""
    rng = np.random.default_rng(seed)
    n_seeds = len(a)
    sizes = {s: len(a[0][s]["conf"]) for s in sets}
    total = sum(sizes.values())

    def delta(seed_idx, q_idx) -> float:
        return sum((np.mean([metric(a[i][s], name, q_idx[s]) for i in seed_idx])
                    - (0.0 if b is None
                       else np.mean([metric(b[i][s], name, q_idx[s]) for i in seed_idx])))
                   * sizes[s] / total for s in sets)

    point = delta(range(n_seeds), {s: np.arange(n) for s, n in sizes.items()})
    draws = np.array([delta(rng.integers(0, n_seeds, n_seeds),
                            {s: rng.integers(0, n, n) for s, n in sizes.items()})
                      for _ in range(n_boot)])
    q_lo, q_hi = np.percentile(draws, [2.5, 97.5])
    return {"delta": float(point), "ci": [float(2 * point - q_hi), float(2 * point - q_lo)],
            "detects": float(DETECTS * draws.std(ddof=1)), "n": total, "seeds": n_seeds}


def verdict(name: str, lo: float, hi: float) -> str:
    if name == "accuracy":
        return "kept" if lo > -ACC_MARGIN else "lost" if hi < -ACC_MARGIN else "inconclusive"
    if name == "nll":
        return "kept" if hi < NLL_MARGIN else "lost" if lo > NLL_MARGIN else "inconclusive"
    if lo > 0 or (lo > -ECE_MARGIN and hi < ECE_MARGIN):
        return "refuted"
    return "holds" if hi < 0 else "inconclusive"


# ---------------------------------------------------------------------------- parts
class Parts:
    def __init__(self, folder: Path, args):
        self.folder, self.args = folder, args

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.json"

    def get(self, name: str) -> dict | None:
        p = self.path(name)
        return json.loads(p.read_text()) if p.is_file() else None

    def put(self, name: str, part: dict) -> dict:
        self.folder.mkdir(parents=True, exist_ok=True)
        part = {"command": self.args.command, "commit": self.args.commit,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **part}
        tmp = self.path(name).with_suffix(".tmp")
        tmp.write_text(json.dumps(part, separators=(",", ":")) + "\n")
        tmp.replace(self.path(name))
        logger.warning("wrote %s", self.path(name))
        return part


def arrays(part: dict, stage: str, reading: str) -> dict:
    return {s: per_question(e["readings"][reading], e["labels"])
            for s, e in part["stages"][stage].items()}


def side(parts: dict, stage: str, reading: str) -> list[dict]:
    kind = next(k for k, names in READINGS.items() if reading in names)
    if kind == "vanilla":
        return [arrays(parts["vanilla"], stage, reading)] * len(SEEDS)
    return [arrays(parts[f"{kind}-s{s}"], stage, reading) for s in SEEDS]


def decide(parts: dict, n_boot: int) -> dict:
    """The go/no-go reading on the selection questions (vanilla and the LoRA only)."""
    rows = {}
    vanilla = arrays(parts["vanilla"], "selection", "vanilla")
    lora = side(parts, "selection", "lora")
    for s in OOD_SETS:
        chance = parts["vanilla"]["stages"]["selection"][s]["chance"]
        acc = metric(vanilla[s], "accuracy")
        d = paired_delta(lora, None, [s], "over_confidence", n_boot)
        over = d["delta"]
        above = acc >= chance + CHANCE_MARGIN
        rows[s] = {"n": len(vanilla[s]["conf"]), "vanilla_accuracy": acc, "chance": chance,
                   "vanilla_over_confidence": metric(vanilla[s], "over_confidence"),
                   "lora_over_confidence": over, "lora_over_confidence_ci": d["ci"],
                   "above_chance": above,
                   "in_regime": above and over >= OVER_CONFIDENCE and d["ci"][0] > 0}
    regime = [s for s, r in rows.items() if r["in_regime"]]
    return {"sets": rows, "regime": regime, "go": len(regime) >= MIN_REGIME_SETS}


# ---------------------------------------------------------------------------- the run
def run(args, parts: Parts) -> None:
    from calm_runtime.cli.common import install_named

    install_named([MODEL], (*TRAIN_SETS, *OOD_SETS))
    reader = Reader(args.eval_batch_size, args.quiet)
    adapters = Path(args.adapters)
    if parts.get("vanilla") is None:
        parts.put("vanilla", read_model(reader, "vanilla", None,
                                        {"selection": None, "test": None, "domain": None},
                                        args.eval_limit))
    decision = None
    for rung in RUNGS:
        for seed in SEEDS:
            name = f"r{rung}-lora-s{seed}"
            if parts.get(name) is None:
                adapter = trained(config("lora", seed, rung, args.smoke),
                                  adapters / name, not args.quiet)
                parts.put(name, {"settings": adapter.method.get("settings"),
                                 "train_s": adapter.metrics["training"]["seconds"],
                                 **read_model(reader, "lora", adapter, {"selection": None},
                                              args.eval_limit)})
        decision = parts.get(f"r{rung}-decision")
        if decision is None:
            decision = parts.put(f"r{rung}-decision", decide(load(parts, rung), args.bootstrap))
        if decision["go"]:
            break
    if not decision["go"]:
        logger.warning("no-go on every rung: no claim is read")
        return
    regime = decision["regime"]
    for seed in SEEDS:
        name = f"r{rung}-lora-s{seed}"
        part = parts.get(name)
        if "test" not in part["stages"]:
            adapter = CalibrationAdapter.from_pretrained(adapters / name)
            more = read_model(reader, "lora", adapter, {"test": regime, "domain": None},
                              args.eval_limit)
            part["stages"] |= more["stages"]
            parts.put(name, {k: v for k, v in part.items()
                             if k not in ("command", "commit", "date")})
        name = f"r{rung}-calm-s{seed}"
        if parts.get(name) is None:
            adapter = trained(config("calm", seed, rung, args.smoke), adapters / name,
                              not args.quiet)
            parts.put(name, {"settings": adapter.method.get("settings"),
                             "train_s": adapter.metrics["training"]["seconds"],
                             "alpha": {"tau": [float(np.min(adapter.tau)),
                                               float(np.max(adapter.tau))],
                                       "shift": [float(np.min(adapter.shift)),
                                                 float(np.max(adapter.shift))]},
                             **read_model(reader, "calm", adapter,
                                          {"test": regime, "domain": None},
                                          args.eval_limit)})


def load(parts: Parts, rung: int) -> dict:
    out = {"vanilla": parts.get("vanilla")}
    for kind in ("lora", "calm"):
        for seed in SEEDS:
            part = parts.get(f"r{rung}-{kind}-s{seed}")
            if part is not None:
                out[f"{kind}-s{seed}"] = part
    return out


# ---------------------------------------------------------------------------- report
def build(parts: Parts, n_boot: int) -> dict | None:
    decisions = {rung: parts.get(f"r{rung}-decision") for rung in RUNGS}
    decisions = {r: d for r, d in decisions.items() if d is not None}
    if not decisions:
        return None
    rung, decision = max(decisions.items())
    payload = {"decisions": {r: {k: d[k] for k in ("sets", "regime", "go")}
                             for r, d in decisions.items()}, "rung": rung,
               "settings": RUNGS[rung], "regime": decision["regime"], "go": decision["go"]}
    loaded = load(parts, rung)
    done = decision["go"] and all(f"{k}-s{s}" in loaded and "test" in loaded[f"{k}-s{s}"]
                                  ["stages"] for k in ("lora", "calm") for s in SEEDS)
    payload["complete"] = done
    if not done:
        return payload
    regime = decision["regime"]

    def rows(spec, stage, sets):
        out = []
        for name, a, b in spec:
            d = paired_delta(side(loaded, stage, a), side(loaded, stage, b), sets, name, n_boot)
            out.append({"metric": name, "a": a, "b": b, **d, "verdict": verdict(name, *d["ci"])})
        return out

    payload["claims"] = rows(CLAIMS, "test", regime)
    payload["beside"] = rows(READ_BESIDE, "test", regime)
    payload["domain"] = rows(DOMAIN_CLAIMS, "domain", list(TRAIN_SETS))
    said = {(c["metric"], c["b"]): c["verdict"] for c in payload["claims"]}
    domain = {c["metric"]: c["verdict"] for c in payload["domain"]}
    payload["default_changes"] = (said[("ece", "lora")] == "holds"
                                  and said[("ece", "lora+ts")] == "holds"
                                  and said[("accuracy", "lora")] == "kept"
                                  and domain["accuracy"] == "kept")
    tables = {}
    for stage, sets in (("test", regime), ("domain", list(TRAIN_SETS))):
        for s in sets:
            tables[f"{s}" + (" (in domain)" if stage == "domain" else "")] = {
                reading: {m: float(np.mean([metric(x[s], m) for x in side(loaded, stage,
                                                                            reading)]))
                          for m in ("accuracy", "ece", "nll", "brier", "mean_confidence")}
                for names in READINGS.values() for reading in names}
    payload["tables"] = tables
    payload["runs"] = {k: {"train_s": v.get("train_s"), "alpha": v.get("alpha"),
                           "ts_temperature": v.get("ts_temperature")}
                       for k, v in loaded.items()}
    return payload


def render(payload: dict) -> str:
    lines = [f"Generated by `{payload['command']}` at {payload['commit']} from the parts made by "
             + ", ".join(f"`{c}`" for c in payload["run_commands"]) + ".", "",
             "The design and the go/no-go rule were written into the script before it ran "
             "(its docstring): SmolLM2-135M-Instruct fine-tuned on SciQ, PIQA, Social IQa and "
             f"MMLU (`train` parts, {STEPS} steps of 8, seeds {', '.join(map(str, SEEDS))}), "
             "read out of domain on selection questions (the regime) and test questions "
             "(the claims), disjoint.", "",
             "## Go/no-go on the selection questions", ""]
    for rung, d in payload["decisions"].items():
        regime = ", ".join(d["regime"]) or "none"
        lines += [f"Rung {rung} ({RUNGS[int(rung)]['steps']} steps): "
                  f"**{'go' if d['go'] else 'no-go'}**, regime: {regime}.",
                  "", "| set | n | chance | vanilla accuracy | vanilla over-conf. | "
                  "LoRA over-conf. [95% CI] | in the regime |", "|---|---|---|---|---|---|---|"]
        for s, r in d["sets"].items():
            lo, hi = r["lora_over_confidence_ci"]
            why = "yes" if r["in_regime"] else "no (vanilla near chance)" \
                if not r["above_chance"] else "no"
            lines.append(f"| {s} | {r['n']} | {r['chance']:.3f} | {r['vanilla_accuracy']:.3f} | "
                         f"{r['vanilla_over_confidence']:+.3f} | {r['lora_over_confidence']:+.3f}"
                         f" [{lo:+.3f}, {hi:+.3f}] | {why} |")
        lines.append("")
    if not payload.get("complete"):
        lines.append("The claims are not read yet (parts still to be made)." if payload["go"]
                     else "No-go on every rung: no claim is read.")
        return "\n".join(lines) + "\n"

    def table(title, rows, note):
        out = [f"## {title}", "", note, "", "| Δ | [95% CI] | detects | verdict |",
               "|---|---|---|---|"]
        for c in rows:
            out.append(f"| {c['metric']}: {c['a']} − {c['b']} | {c['delta']:+.4f} "
                       f"[{c['ci'][0]:+.4f}, {c['ci'][1]:+.4f}] | {c['detects']:.4f} | "
                       f"**{c['verdict']}** |")
        return out + [""]
    regime = ", ".join(payload["regime"])
    lines += table("The claims, out of domain (test questions)", payload["claims"],
                   f"Sets: {regime}; pooled, question-weighted, paired over seeds and "
                   "questions. ECE holds below 0 outside ±0.01; accuracy kept above −0.03.")
    lines += table("Read beside them (not claims)", payload["beside"], f"Sets: {regime}.")
    lines += table("In domain (test parts of the training sets)", payload["domain"],
                   "Non-inferiority: accuracy kept above −0.03, NLL kept below +0.02 nats.")
    lines += ["## What this decides", "",
              ("CALM as specified beats the plain LoRA and the LoRA with temperature scaling "
               "out of domain without losing accuracy: it becomes `calm train`'s default."
               if payload["default_changes"] else
               "CALM as specified does not beat both the plain LoRA and the LoRA with "
               "temperature scaling out of domain with its accuracy kept (the rule above): "
               "`calm train`'s default does not change to it."), "",
              "## Every set and reading (means over seeds)", "",
              "| set | reading | accuracy | ECE | NLL | Brier | mean confidence |",
              "|---|---|---|---|---|---|---|"]
    for s, readings in payload["tables"].items():
        for name, r in readings.items():
            lines.append(f"| {s} | {name} | {r['accuracy']:.3f} | {r['ece']:.3f} | "
                         f"{r['nll']:.3f} | {r['brier']:.3f} | {r['mean_confidence']:.3f} |")
    lines += ["", "## Runs", ""]
    for name, r in payload["runs"].items():
        said = [f"trained in {r['train_s']:.0f} s" if r.get("train_s") else None,
                f"in-domain TS temperature {r['ts_temperature']:.3f}"
                if r.get("ts_temperature") else None,
                (f"τ in [{r['alpha']['tau'][0]:.4f}, {r['alpha']['tau'][1]:.4f}], shift in "
                 f"[{r['alpha']['shift'][0]:+.4f}, {r['alpha']['shift'][1]:+.4f}]")
                if r.get("alpha") else None]
        lines.append(f"- {name}: " + "; ".join(x for x in said if x))
    lines += ["", "Per-question option probabilities and labels of every reading: the parts "
              f"folder `research/results/{NAME}.parts/` (recompute any number above from them)."]
    return "\n".join(lines) + "\n"


def report(args, parts: Parts) -> int:
    payload = build(parts, args.bootstrap)
    if payload is None:
        logger.warning("no decision made yet; run the experiment first")
        return 1
    commands = sorted({p["command"] for p in (parts.get(f.stem) for f in
                                               sorted(parts.folder.glob("*.json"))) if p})
    payload = {"command": args.command, "commit": args.commit, "run_commands": commands,
               **payload}
    out = Path(args.out)
    (out / f"{NAME}.json").write_text(json.dumps(payload, indent=1) + "\n")
    text = render(payload)
    (out / f"{NAME}.md").write_text(text)
    sys.stdout.write(text)
    return 0


def git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", action="store_true", help="only the report from the parts")
    parser.add_argument("--eval-batch-size", type=int, default=16)
    parser.add_argument("--bootstrap", type=int, default=2000,
                        help="resamples of each paired interval")
    parser.add_argument("--smoke", action="store_true", help="2 steps, 8 questions per set")
    parser.add_argument("--adapters", default=str(HERE / "out" / NAME / "adapters"))
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    args.command = f"python research/{NAME}.py {shlex.join(argv or sys.argv[1:])}".strip()
    args.commit = git_commit()
    args.eval_limit = None
    if args.smoke:
        args.eval_limit, args.bootstrap = 8, 50
        args.adapters = str(HERE / "out" / f"{NAME}-smoke" / "adapters")
        if args.out == str(HERE / "results"):  # a smoke run never replaces the results
            args.out = str(HERE / "out" / f"{NAME}-smoke")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parts = Parts(Path(args.out) / f"{NAME}.parts", args)
    if not args.report:
        run(args, parts)
    return report(args, parts)


if __name__ == "__main__":
    sys.exit(main())
