"""DACA in its own regime: post-trained models of the reference's own family.

    python benchmarks/daca_regime.py --polm lora-60=adapters/gemma-lora-60 \\
        --polm lora-sharp=adapters/gemma-lora-sharp --test-limit mmlu=400
    python benchmarks/daca_regime.py --polm lora-60=ADAPTER --modes cloze   # cloze only
    python benchmarks/daca_regime.py --render       # rewrite the .md from the committed .json

DACA (docs/methods.md §3) assumes the model to calibrate is the post-trained version of
its reference: more accurate and over-confident. Naive alignment (the KL to the reference
on every question) is then pulled toward too high a temperature (the paper's
Proposition 3.3: a disagreement on which the reference gives the model's answer less than
1/K has its optimum at T = inf) and the agreement mask is the fix. Each ``--polm`` is a
calm adapter (a LoRA, e.g. from ``calm train --method lora``) applied to ``--model``; the
reference is ``--reference`` (by default the same base model, so the pair is one family).

For each PoLM, data set and mode it fits vanilla, naive alignment, DACA (scalar and vector)
and labeled temperature scaling on the fit part and evaluates them on the test part
(accuracy, ECE with a 95% bootstrap interval), and reports the fitted temperatures, the
agreement rate and the share of disagreements on which the reference gives the PoLM's
answer less than 1/K. The split is the fixed one of ``benchmarks/calibration.py`` and
``calm fit`` (30% calibration, seed 0); on a set the PoLM was trained on (``NAME:train`` in
its adapter's provenance, the first half of the calibration part) the fit part is the
other half (``NAME:unlabeled``, labels kept for TS), so no method is fitted on a record
the PoLM trained on. A set is in domain when the adapter trained on it.

Letter mode runs only for a (PoLM, set) whose letter accuracy on the first
``--letter-probe`` (evaluated) test questions is above chance (one-sided binomial test at 5%); the
probe is reported either way. Scores are cached (``$CALM_CACHE/scores``); a rerun with the
same adapters and limits only refits. Writes ``results/daca_regime.json`` and
``results/daca_regime.md``, both naming the command and the commit.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import numpy as np
from _common import command_line, git_commit

from calm_runtime.cli.common import install_named
from calm_runtime.data.prompts import CHOICE_MODES
from calm_runtime.data.sets import load_dataset, split_indices
from calm_runtime.errors import ConfigError, FitError
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_runtime.measure import metrics
from calm_runtime.temperature import TemperatureFit, fit_temperature_scaling
from calm_training.fit import apply_fit, option_probabilities
from calm_training.methods.calm import TRAIN_PART, TRAIN_SPLIT_FRACTION, TRAIN_SPLIT_SEED
from calm_training.methods.daca import fit_daca_temperature
from calm_training.methods.vector import VectorFit, fit_daca_vector_scaling
from calm_training.posthoc.fit_config import DEFAULT_VARIANT
from calm_training.scoring.cache import cached_option_scores

HERE = Path(__file__).resolve().parent
METHODS = ("vanilla", "naive", "daca", "daca-vector", "ts")
STEM = "daca_regime"
logger = logging.getLogger("daca_regime")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--polm", action="append", default=[], metavar="NAME=ADAPTER",
                        help="a post-trained model: a name for the tables and a calm adapter "
                        "folder applied to --model (repeatable)")
    parser.add_argument("--model", default="gemma-3-270m", help="the base the adapters apply to")
    parser.add_argument("--reference", default="gemma-3-270m")
    parser.add_argument("--data", nargs="+", default=["arc-easy", "sciq", "mmlu",
                                                      "arc-challenge"])
    parser.add_argument("--modes", nargs="+", default=list(CHOICE_MODES),
                        choices=list(CHOICE_MODES))
    parser.add_argument("--variant", default=DEFAULT_VARIANT, choices=["sum", "mean", "char"],
                        help="cloze option score of both models (default %(default)s)")
    parser.add_argument("--test-limit", action="append", default=[], metavar="NAME=N",
                        help="evaluate on N records of NAME's test part only (drawn at random, "
                        "seed 0; repeatable)")
    parser.add_argument("--fit-limit", action="append", default=[], metavar="NAME=N",
                        help="fit on N records of NAME's fit part only (at random, seed 0; "
                        "repeatable; for large out-of-domain sets on a small CPU budget)")
    parser.add_argument("--letter-probe", type=int, default=200,
                        help="test questions on which letter accuracy is measured before "
                        "letter mode is run (default %(default)s)")
    parser.add_argument("--bins", type=int, default=10)
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--note", help="a sentence for the header of the .md (kept in the JSON)")
    parser.add_argument("--render", action="store_true",
                        help="no scoring: rewrite OUT/daca_regime.md from OUT/daca_regime.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    command = command_line("daca_regime.py", argv)
    out = Path(args.out)
    if args.render:
        payload = json.loads((out / f"{STEM}.json").read_text())
        if args.note:
            payload["note"] = args.note
        payload["rendered"] = {"command": command.strip(), "commit": git_commit()}
        (out / f"{STEM}.json").write_text(json.dumps(payload, indent=1) + "\n")
        (out / f"{STEM}.md").write_text(markdown(payload))
        return 0
    polms = _pairs(args.polm, "--polm", str)
    if not polms:
        parser.error("give at least one --polm NAME=ADAPTER (or --render)")
    limits = _pairs(args.test_limit, "--test-limit", int)
    fit_limits = _pairs(args.fit_limit, "--fit-limit", int)
    install_named([args.model, args.reference], args.data)
    start = time.perf_counter()
    payload = {"command": command.strip(), "commit": git_commit(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "model": args.model, "reference": args.reference, "variant": args.variant,
               "bins": args.bins, "bootstrap": args.bootstrap,
               "test_limits": limits, "fit_limits": fit_limits, "polms": {},
               "letter_probe": [], "groups": [], "rows": []}
    if args.note:
        payload["note"] = args.note
    for name, adapter in polms.items():
        trained = _trained_sets(adapter)
        payload["polms"][name] = {"adapter": adapter, "trained_on": sorted(trained),
                                  **_training_summary(adapter)}
        for data in args.data:
            split = _split(data, trained, limits.get(data), fit_limits.get(data))
            for mode in args.modes:
                if mode == "letter":
                    probe = _letter_probe(args, name, adapter, data, split)
                    payload["letter_probe"].append(probe)
                    if not probe["run"]:
                        logger.info("%s on %s: letter accuracy %.3f on %d questions is not "
                                    "above chance (%.3f needed); letter mode skipped", name,
                                    data, probe["accuracy"], probe["n"], probe["needed"])
                        continue
                group, rows = _evaluate(args, name, adapter, data, mode, split)
                payload["groups"].append(group)
                payload["rows"].extend(rows)
    payload["wall_s"] = round(time.perf_counter() - start, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{STEM}.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / f"{STEM}.md").write_text(markdown(payload))
    logger.info("wrote %s and its .md in %.0f s", out / f"{STEM}.json", payload["wall_s"])
    return 0


def _pairs(values, option: str, convert) -> dict:
    pairs = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key or not rest:
            raise ConfigError(f"{option} {value!r}: write NAME=VALUE")
        pairs[key] = convert(rest)
    return pairs


def _trained_sets(adapter: str) -> set[str]:
    """The named sets whose ``:train`` part the adapter's LoRA was trained on; any other
    part of a set is refused (it would overlap the fit or test part)."""
    manifest = CalibrationAdapter.from_pretrained(adapter)
    specs = [entry["spec"] for entry in (manifest.provenance or {}).get("train_data", [])]
    trained = set()
    for spec in specs:
        head, _, part = spec.rpartition(":")
        if part != TRAIN_PART:
            raise ConfigError(f"{adapter} was trained on {spec!r}; this benchmark needs "
                              f"training on NAME:{TRAIN_PART} parts only, disjoint from the "
                              "fit and test parts")
        trained.add(head)
    return trained


def _training_summary(adapter: str) -> dict:
    manifest = CalibrationAdapter.from_pretrained(adapter)
    method = manifest.method or {}
    settings = method.get("settings") or {}
    keep = ("method", "steps", "batch_size", "outer_lr", "lora_rank", "mode", "seed",
            "init_lora")
    summary = {k: settings[k] for k in keep if k in settings}
    seconds = ((manifest.metrics or {}).get("training") or {}).get("seconds")
    if seconds is not None:
        summary["seconds"] = seconds
    return {"training": summary}


def _split(data: str, trained: set[str], test_limit: int | None = None,
           fit_limit: int | None = None) -> dict:
    """Indices into the scored records: ``fit`` (the calibration part, without the PoLM's
    training half on a set it trained on; ``fit_limit`` of them) and ``test`` (the test
    part; ``test_limit`` of it), plus ``records``, the records to score: all of them
    unless a part is cut, else the two parts (so the cache key changes with the cuts)."""
    records = load_dataset(data)
    cal, test = split_indices(len(records))
    in_domain = data in trained
    if in_domain:
        train_half, _ = split_indices(len(cal), TRAIN_SPLIT_FRACTION, TRAIN_SPLIT_SEED)
        cal = np.setdiff1d(cal, cal[train_half])
    cal, test = _cut(cal, fit_limit), _cut(test, test_limit)
    cut = test_limit is not None or fit_limit is not None
    scored = np.union1d(cal, test) if cut else np.arange(len(records))
    position = {int(i): j for j, i in enumerate(scored)}
    return {"records": [records[i] for i in scored], "in_domain": in_domain,
            "fit": np.array([position[int(i)] for i in cal]),
            "test": np.array([position[int(i)] for i in test]),
            "n_total": len(records)}


def _cut(part: np.ndarray, limit: int | None) -> np.ndarray:
    """``limit`` indices of ``part`` drawn at random (seed 0), in file order: a named set may
    be sorted (MMLU by subject), so its first records would be a few subjects only."""
    if limit is None or limit >= part.size:
        return part
    return np.sort(np.random.default_rng(0).choice(part, limit, replace=False))


def _scores(args, spec: str, adapter: str | None, records, mode: str) -> np.ndarray:
    t0 = time.perf_counter()
    scores = cached_option_scores(spec, records, mode=mode, adapter_dir=adapter,
                                  batch_size=args.batch_size, progress=False)
    logger.info("%s%s: %d records (%s) scored in %.0f s", spec,
                f" + {adapter}" if adapter else "", len(records), mode,
                time.perf_counter() - t0)
    return scores


def _letter_probe(args, name: str, adapter: str, data: str, split: dict) -> dict:
    """Letter accuracy of the PoLM (and the reference) on the first test questions; letter
    mode is run when the PoLM's is above chance by a one-sided binomial test at 5%."""
    idx = split["test"][: args.letter_probe]
    records = [split["records"][i] for i in idx]
    k = int(np.bincount([len(r.choices) for r in records]).argmax())
    keep = np.array([len(r.choices) == k for r in records])
    labels = np.array([r.answer for r in records])[keep]
    out = {"polm": name, "eval_set": data, "n": int(keep.sum()), "chance": 1.0 / k}
    for role, spec, adp in (("accuracy", args.model, adapter),
                            ("reference_accuracy", args.reference, None)):
        s = _scores(args, spec, adp, records, "letter").scores("sum")[keep][:, :k]
        out[role] = float((s.argmax(1) == labels).mean())
    out["needed"] = _above_chance_threshold(out["n"], 1.0 / k)
    out["run"] = out["accuracy"] >= out["needed"]
    return out


def _above_chance_threshold(n: int, p0: float, alpha: float = 0.05) -> float:
    """The smallest accuracy c/n whose one-sided binomial p-value against ``p0`` is < alpha."""
    tail = 0.0
    for c in range(n, -1, -1):
        tail += math.comb(n, c) * p0 ** c * (1 - p0) ** (n - c)
        if tail >= alpha:
            return (c + 1) / n
    return 0.0


def _evaluate(args, name: str, adapter: str, data: str, mode: str, split: dict):
    records = split["records"]
    polm_scores = _scores(args, args.model, adapter, records, mode)
    plm_scores = _scores(args, args.reference, None, records, mode)
    variant = args.variant if mode == "cloze" else "sum"
    k = int(np.bincount(polm_scores.n_options).argmax())
    keep = polm_scores.n_options == k
    fit_idx, test_idx = split["fit"][keep[split["fit"]]], split["test"][keep[split["test"]]]
    g, f = polm_scores.scores(variant)[:, :k], plm_scores.scores(variant)[:, :k]
    labels = polm_scores.labels
    group = {"polm": name, "eval_set": data, "in_domain": split["in_domain"], "mode": mode,
             "n_options": k, "n_fit": int(fit_idx.size), "n_test": int(test_idx.size),
             "n_total": split["n_total"],
             "fit": _disagreement(f[fit_idx], g[fit_idx]),
             "test": _disagreement(f[test_idx], g[test_idx]),
             "reference_on_test": _metrics(option_probabilities(f[test_idx]),
                                           labels[test_idx], args)}
    rows = []
    for method in METHODS:
        try:
            fit = _fit(method, f[fit_idx], g[fit_idx], labels[fit_idx])
        except FitError as exc:
            logger.warning("%s / %s / %s / %s: %s", name, data, mode, method, exc)
            continue
        probs = apply_fit(fit, g[test_idx])
        m = _metrics(probs, labels[test_idx], args)
        row = {"polm": name, "eval_set": data, "in_domain": split["in_domain"], "mode": mode,
               "method": method, "accuracy": m["accuracy"], "ece": m["ece"],
               "ece_ci": m["ece_ci"], "temperature": _temperature(fit),
               "agreement": group["fit"]["agreement"],
               "below_1_over_k": group["fit"]["below_1_over_k"],
               "n_fit": group["n_fit"], "n_test": group["n_test"],
               "nll": m["nll"], "brier": m["brier"], "mean_confidence": m["mean_confidence"]}
        if isinstance(fit, TemperatureFit) and fit.at_bound:
            row["at_bound"] = fit.at_bound
        if isinstance(fit, VectorFit):
            row["weights"], row["bias"] = list(fit.weights), list(fit.bias)
        rows.append(row)
    logger.info("%s / %s / %s: %s", name, data, mode, ", ".join(
        f"{r['method']} ECE {r['ece']:.3f} T {r['temperature']}" for r in rows))
    return group, rows


def _disagreement(f: np.ndarray, g: np.ndarray) -> dict:
    """Agreement rate, and on the disagreements the share where the reference gives the
    PoLM's answer less than 1/K (Prop. 3.3's case: naive alignment's optimum is T = inf)."""
    answer = g.argmax(1)
    agree = f.argmax(1) == answer
    p_answer = option_probabilities(f)[np.arange(len(answer)), answer]
    low = (~agree) & (p_answer < 1.0 / f.shape[1])
    n_dis = int((~agree).sum())
    return {"agreement": float(agree.mean()), "n_disagree": n_dis,
            "below_1_over_k": float(low.sum() / n_dis) if n_dis else 0.0,
            "below_1_over_k_of_all": float(low.mean())}


def _fit(method: str, f, g, labels):
    if method == "vanilla":
        return None
    if method in ("naive", "daca"):
        return fit_daca_temperature(f, g, mask=method == "daca")
    if method == "daca-vector":
        return fit_daca_vector_scaling(f, g)
    return fit_temperature_scaling(g, labels)


def _temperature(fit) -> float | None:
    """1 for vanilla, None for vector scaling and for an infinite temperature (its
    ``at_bound`` says which)."""
    if fit is None:
        return 1.0
    if isinstance(fit, VectorFit) or not math.isfinite(fit.temperature):
        return None
    return float(fit.temperature)


def _metrics(probs: np.ndarray, labels: np.ndarray, args) -> dict:
    report = metrics.calibration_report(probs, labels, args.bins)
    conf = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == labels).astype(float)
    ci = metrics.bootstrap_interval(lambda c, y: metrics.ece(c, y, args.bins), conf, correct,
                                    n_resamples=args.bootstrap)
    return {"accuracy": float(report["accuracy"]), "ece": float(report["ece"]),
            "ece_ci": [float(ci[0]), float(ci[1])], "nll": float(report["nll"]),
            "brier": float(report["brier"]), "mean_confidence": float(conf.mean())}


# ------------------------------------------------------------------------------ report


def markdown(payload: dict) -> str:
    limits = payload.get("test_limits") or {}
    fit_limits = payload.get("fit_limits") or {}
    lines = ["# DACA in its own regime", "",
             f"Generated by `{payload['command']}` at commit {payload['commit']} on "
             f"{payload['date']} ({payload['wall_s']} s); do not edit by hand."]
    if payload.get("rendered"):
        lines.append(f"Rendered from `{STEM}.json` by `{payload['rendered']['command']}` at "
                     f"commit {payload['rendered']['commit']}.")
    if payload.get("note"):
        lines.append(payload["note"].strip())
    lines += ["", f"PoLMs: LoRA adapters on {payload['model']}; reference (PLM): "
              f"{payload['reference']}. Fit on the calibration part (30%, seed 0) minus the "
              "PoLM's training half on in-domain sets"
              + (" (cut to a random " + ", ".join(f"{n} of {d}" for d, n in fit_limits.items())
                 + ")" if fit_limits else "")
              + "; metrics on the test part"
              + (" (cut to a random " + ", ".join(f"{n} of {d}" for d, n in limits.items())
                 + ")" if limits else "")
              + f"; cloze {payload['variant']} scores for both models; ECE with "
              f"{payload['bins']} bins and a 95% bootstrap interval ({payload['bootstrap']} "
              "resamples). T: fitted temperature (inf: the optimum is the uniform "
              "distribution). agree: agreement rate on the fit part; <1/K: share of the fit "
              "part's disagreements on which the reference gives the PoLM's answer less "
              "than 1/K (Proposition 3.3's case).", ""]
    for name, info in payload["polms"].items():
        train = info.get("training") or {}
        lines += [f"## {name}", "",
                  f"Adapter `{info['adapter']}`, trained on "
                  f"{', '.join(t + ':train' for t in info['trained_on'])}"
                  + (f" ({', '.join(f'{k} {v}' for k, v in train.items())})" if train else "")
                  + ".", "",
                  "| set | mode | n fit / test | base acc (ECE) | PoLM acc | agree | <1/K | "
                  "T naive | T DACA | T TS | ECE vanilla | ECE naive | ECE DACA | "
                  "ECE DACA-vector | ECE TS |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for group in payload["groups"]:
            if group["polm"] != name:
                continue
            rows = {r["method"]: r for r in payload["rows"] if r["polm"] == name
                    and r["eval_set"] == group["eval_set"] and r["mode"] == group["mode"]}
            label = group["eval_set"] + (" (in domain)" if group["in_domain"] else "")
            lines.append(
                f"| {label} | {group['mode']} | {group['n_fit']} / {group['n_test']} | "
                f"{group['reference_on_test']['accuracy']:.3f} "
                f"({group['reference_on_test']['ece']:.3f}) | "
                f"{_cell(rows, 'vanilla', 'accuracy')} | {group['fit']['agreement']:.2f} | "
                f"{group['fit']['below_1_over_k']:.2f} | {_temp(rows, 'naive')} | "
                f"{_temp(rows, 'daca')} | {_temp(rows, 'ts')} | "
                + " | ".join(_ece(rows, m) for m in ("vanilla", "naive", "daca",
                                                      "daca-vector", "ts")) + " |")
        lines.append("")
    probes = payload.get("letter_probe") or []
    if probes:
        lines += ["## Letter-mode probe", "",
                  "Letter accuracy on the first test questions; letter mode runs only where "
                  "the PoLM is above chance (one-sided binomial test, 5%).", "",
                  "| PoLM | set | n | PoLM letter acc | reference letter acc | needed | run |",
                  "|---|---|---|---|---|---|---|"]
        for p in probes:
            lines.append(f"| {p['polm']} | {p['eval_set']} | {p['n']} | {p['accuracy']:.3f} | "
                         f"{p['reference_accuracy']:.3f} | {p['needed']:.3f} | "
                         f"{'yes' if p['run'] else 'skipped'} |")
        lines.append("")
    return "\n".join(lines)


def _cell(rows: dict, method: str, key: str) -> str:
    row = rows.get(method)
    return "-" if row is None else f"{row[key]:.3f}"


def _temp(rows: dict, method: str) -> str:
    row = rows.get(method)
    if row is None:
        return "-"
    return "inf" if row["temperature"] is None else f"{row['temperature']:.2f}"


def _ece(rows: dict, method: str) -> str:
    row = rows.get(method)
    if row is None:
        return "fit failed"
    lo, hi = row["ece_ci"]  # no method's number is set apart: the intervals say what differs
    return f"{row['ece']:.3f} [{lo:.3f}, {hi:.3f}]"


if __name__ == "__main__":
    sys.exit(main())
