"""Open QA: greedy answers, correctness by alias match, P(True), and its calibration.

docs/methods.md §2–§3: the post-trained model answers each question greedily; each model
(PoLM and, for DACA, the PLM) judges that answer with a named P(True) template; the
two-way ``[true, false]`` logits are calibrated like option logits (DACA on the two-way
distributions, or temperature scaling against answer correctness). The fitted
temperature is token-level, so it fuses into the engine's LM head.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import numpy as np

from calm_runtime._fs import sha256_bytes
from calm_runtime._paths import cache_dir
from calm_runtime.data.prompts import p_true_template
from calm_runtime.data.sets import dataset_hash
from calm_runtime.errors import ConfigError, FitError
from calm_runtime.measure import metrics
from calm_training.methods import P_TRUE_METHODS, p_true_method
from calm_training.posthoc.fit_report import add_selective, served_floor
from calm_training.posthoc.plan import FitPlan
from calm_training.posthoc.platt import PlattFit, fit_platt  # noqa: F401 - Platt scaling stays importable from here
from calm_training.scoring.answers import generate_answers, score_p_true
from calm_training.scoring.local import is_correct
from calm_training.scoring.served import remote_answers, remote_p_true

__all__ = ["P_TRUE_METHODS", "PlattFit", "compare_p_true", "fit_p_true", "fit_platt",
           "open_qa_judgements"]

logger = logging.getLogger(__name__)

ANSWER_VERSION = 1  # bump when generation or judging changes (invalidates the cache)


def _cache_path(kind: str, material: dict) -> Path:
    key = sha256_bytes(json.dumps(material, sort_keys=True).encode())[:40]
    return cache_dir("scores") / f"{kind}-{key}.json"


def _load_or(path: Path, compute):
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except ValueError:
            logger.warning("ignoring unreadable cache entry %s", path)
    value = compute()
    handle, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(handle, "w") as out:
        json.dump(value, out)
    os.replace(tmp, path)
    return value


def open_qa_judgements(plan: FitPlan, *, progress: bool = True) -> dict:
    """PoLM answers, their correctness, and each model's two-way P(True) logits (cached)."""
    config = plan.config
    records = plan.records
    template = p_true_template(config.p_true_template)
    sources = {"polm": plan.model}
    if plan.reference is not None:
        sources["plm"] = plan.reference
    if plan.served:
        return _remote_judgements(sources, records, template, chat=config.chat,
                                  progress=progress)
    base = {"version": ANSWER_VERSION, "data": dataset_hash(records),
            "polm": sources["polm"].fingerprint()}
    loaded = {}

    def model(source):
        if source.spec not in loaded:
            loaded[source.spec] = source.load()[:2]
        return loaded[source.spec]

    answers = _load_or(_cache_path("answers", base), lambda: generate_answers(
        *model(sources["polm"]), [r.question for r in records], progress=progress,
        max_length=config.max_length))
    correct = [is_correct(a, r.answers) for a, r in zip(answers, records, strict=True)]
    out = {"records": records, "answers": answers, "correct": np.array(correct, dtype=float)}
    for role, source in sources.items():
        material = {**base, "judge": source.fingerprint(),
                    "template": template.to_dict(), "chat": config.chat}
        logits = _load_or(_cache_path("ptrue", material), lambda source=source: score_p_true(
            *model(source), [r.question for r in records], answers, template, chat=config.chat,
            batch_size=config.batch_size, progress=progress,
            max_length=config.max_length).tolist())
        out[role] = np.asarray(logits, dtype=float)
    return out


def _remote_judgements(sources: dict, records, template, *, chat: bool | None,
                       progress: bool) -> dict:
    """:func:`open_qa_judgements` when the model (and the reference) are served: both
    through their endpoints (each request cached by the remote scorer)."""
    if not all(s.served for s in sources.values()):
        raise ConfigError("P(True) with a served model needs a served reference too (or "
                          "none); pass both as endpoint URLs")
    questions = [r.question for r in records]
    polm = sources["polm"]
    answers = remote_answers(polm.endpoint, questions, progress=progress)
    correct = [is_correct(a, r.answers) for a, r in zip(answers, records, strict=True)]
    out = {"records": records, "answers": answers, "correct": np.array(correct, dtype=float),
           "floored": {}}
    for role, source in sources.items():
        out[role], stats = remote_p_true(source.endpoint, questions, answers, template,
                                         progress=progress, chat=source.chat(chat))
        out["floored"]["model" if role == "polm" else "reference"] = stats.floored
    return out


def _p(two_way: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """P(True) from ``[true, false]`` logits at temperature ``T``."""
    z = two_way / temperature
    return 1.0 / (1.0 + np.exp(np.clip(z[:, 1] - z[:, 0], -700, 700)))


def _fit(method: str, judged: dict, cal: np.ndarray):
    fitted = p_true_method(method)
    if fitted.needs_reference and "plm" not in judged:
        raise ConfigError("label-free P(True) calibration needs --reference")
    return fitted.fit_p_true(judged["polm"][cal],
                             reference=judged["plm"][cal] if fitted.needs_reference else None,
                             correct=judged["correct"][cal], p_true=_p)


def compare_p_true(plan: FitPlan, methods=P_TRUE_METHODS, *, progress: bool = True) -> dict:
    """Fit P(True) calibrations on the calibration split; binary metrics on the test split.

    The label of an item is whether the PoLM's answer is correct; the confidence is
    P(True) (docs/methods.md §5).
    """
    judged = open_qa_judgements(plan, progress=progress)
    n = len(judged["records"])
    cal, test = plan.split
    settings = plan.metrics
    rows, panels = {}, {}
    for method in methods:
        try:
            fit = _fit(method, judged, cal)
        except FitError as exc:  # e.g. no wrong answer to fit against: a result, not a crash
            logger.warning("%s: %s", method, exc)
            rows[method] = {"error": str(exc)}
            continue
        p = (fit.apply(judged["polm"][test]) if isinstance(fit, PlattFit)
             else _p(judged["polm"][test], 1.0 if fit is None else fit.temperature))
        y = judged["correct"][test]
        row = metrics.binary_report(p, y, settings.n_bins)
        add_selective(row, p, y, settings)
        row["fit"] = None if fit is None else fit.to_dict()
        rows[method], panels[method] = row, (p, y)
    report = {"config": plan.config.to_dict(), "data_hash": dataset_hash(judged["records"]),
              "n_records": n, "n_calibration": int(cal.size), "n_test": int(test.size),
              "answer_accuracy": float(judged["correct"].mean()), "methods": rows,
              "_panels": panels}
    floor = served_floor(judged.get("floored", {}), n)  # served models: True/False tokens
    if floor:
        report["served_floor"] = floor
    if "plm" in judged:
        p_plm = _p(judged["plm"][test])
        report["reference_on_test"] = metrics.binary_report(p_plm, judged["correct"][test],
                                                            settings.n_bins)
        report["agreement_rate"] = float(((_p(judged["plm"][cal]) > 0.5)
                                          == (_p(judged["polm"][cal]) > 0.5)).mean())
    return report


def fit_p_true(plan: FitPlan, method: str):
    """Fit ``method`` on the calibration split; returns ``(fit, n_calibration, data_hash)``."""
    judged = open_qa_judgements(plan)
    cal, _ = plan.split
    fitted = p_true_method(method)
    if not fitted.writes_adapter:  # the baseline, or compared only (Platt)
        raise ConfigError(f"{fitted.refusal}; choose daca, naive or ts")
    return _fit(method, judged, cal), int(cal.size), dataset_hash(judged["records"])
