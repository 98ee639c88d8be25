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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from calm_runtime import metrics
from calm_runtime._fs import sha256_bytes
from calm_runtime._paths import cache_dir
from calm_runtime.data import OpenQARecord, dataset_hash, load_dataset, split_indices
from calm_runtime.errors import ConfigError, DataError, FitError
from calm_runtime.prompts import p_true_template

from . import daca
from .answers import generate_answers, score_p_true
from .fit_report import add_selective, served_floor
from .remote import remote_answers, remote_p_true
from .scoring import is_correct
from .sources import model_source

__all__ = ["P_TRUE_METHODS", "compare_p_true", "fit_p_true", "open_qa_judgements"]

logger = logging.getLogger(__name__)

P_TRUE_METHODS = ("vanilla", "naive", "daca", "ts", "platt")


@dataclass(frozen=True)
class PlattFit:
    """``P(True) = sigmoid(slope * d + bias)`` with ``d = z_true - z_false``: a temperature
    (``1 / slope``) and a shift, which moves the base rate where a temperature cannot.
    Fitted by Newton's method on the binary NLL against answer correctness (convex)."""

    slope: float
    bias: float
    n_used: int
    iterations: int
    method: str = "platt"

    @property
    def temperature(self) -> float:
        return 1.0 / self.slope if self.slope else float("inf")

    def apply(self, two_way: np.ndarray) -> np.ndarray:
        d = two_way[:, 0] - two_way[:, 1]
        return 1.0 / (1.0 + np.exp(-np.clip(self.slope * d + self.bias, -700, 700)))

    def to_dict(self) -> dict:
        return {"method": self.method, "slope": self.slope, "bias": self.bias,
                "temperature": self.temperature, "n_used": self.n_used,
                "iterations": self.iterations}


def fit_platt(two_way: np.ndarray, correct: np.ndarray, *, max_iter: int = 100,
              tol: float = 1e-10) -> PlattFit:
    """Platt scaling of two-way logits against 0/1 correctness (damped Newton steps)."""
    d = two_way[:, 0] - two_way[:, 1]
    y = np.asarray(correct, dtype=float)
    if y.min() == y.max():
        raise FitError("Platt scaling needs both correct and wrong answers on the calibration "
                       "split; use more data")
    x = np.stack([d, np.ones_like(d)], axis=1)
    w = np.zeros(2)

    def loss(w):
        z = x @ w
        return float(np.mean(np.logaddexp(0.0, z) - y * z))

    iterations = 0
    for _ in range(max_iter):
        iterations += 1
        p = 1.0 / (1.0 + np.exp(-np.clip(x @ w, -700, 700)))
        grad = x.T @ (p - y) / y.size
        hess = (x * (p * (1 - p))[:, None]).T @ x / y.size + 1e-12 * np.eye(2)
        step = np.linalg.solve(hess, grad)
        scale, current = 1.0, loss(w)
        while loss(w - scale * step) > current and scale > 1e-8:
            scale /= 2
        w = w - scale * step
        if np.abs(scale * step).max() < tol:
            break
    return PlattFit(float(w[0]), float(w[1]), int(y.size), iterations)
ANSWER_VERSION = 1  # bump when generation or judging changes (invalidates the cache)


def _records(config) -> list[OpenQARecord]:
    records = load_dataset(config.data)
    if records and not isinstance(records[0], OpenQARecord):
        raise DataError(f"{config.data} holds multiple-choice records; P(True) mode needs open-QA "
                        "data (question, answers)")
    return records[: config.limit] if config.limit else records


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


def open_qa_judgements(config, *, progress: bool = True) -> dict:
    """PoLM answers, their correctness, and each model's two-way P(True) logits (cached)."""
    records = _records(config)
    template = p_true_template(config.p_true_template)
    sources = {"polm": model_source(config, "model")}
    if config.reference:
        sources["plm"] = model_source(config, "reference")
    if any(s.served for s in sources.values()):
        return _remote_judgements(config, sources, records, template, progress=progress)
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


def _remote_judgements(config, sources: dict, records, template, *, progress: bool) -> dict:
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
                                         progress=progress, chat=source.chat(config.chat))
        out["floored"]["model" if role == "polm" else "reference"] = stats.floored
    return out


def _p(two_way: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """P(True) from ``[true, false]`` logits at temperature ``T``."""
    z = two_way / temperature
    return 1.0 / (1.0 + np.exp(np.clip(z[:, 1] - z[:, 0], -700, 700)))


def _fit(method: str, judged: dict, cal: np.ndarray):
    g = judged["polm"][cal]
    if method == "vanilla":
        return None
    if method in ("naive", "daca"):
        if "plm" not in judged:
            raise ConfigError("label-free P(True) calibration needs --reference")
        return daca.fit_daca_p_true(_p(judged["plm"][cal]), _p(g), mask=method == "daca")
    if method == "ts":
        return daca.fit_temperature_scaling(g, (1 - judged["correct"][cal]).astype(int))
    if method == "platt":
        return fit_platt(g, judged["correct"][cal])
    raise ConfigError(f"unknown P(True) method {method!r}; choose one of "
                      f"{', '.join(P_TRUE_METHODS)}")


def compare_p_true(config, methods=P_TRUE_METHODS, *, progress: bool = True) -> dict:
    """Fit P(True) calibrations on the calibration split; binary metrics on the test split.

    The label of an item is whether the PoLM's answer is correct; the confidence is
    P(True) (docs/methods.md §5).
    """
    judged = open_qa_judgements(config, progress=progress)
    n = len(judged["records"])
    cal, test = split_indices(n, config.calibration_fraction, config.seed)
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
        row = metrics.binary_report(p, y, config.n_bins)
        add_selective(row, p, y, config)
        row["fit"] = None if fit is None else fit.to_dict()
        rows[method], panels[method] = row, (p, y)
    report = {"config": config.to_dict(), "data_hash": dataset_hash(judged["records"]),
              "n_records": n, "n_calibration": int(cal.size), "n_test": int(test.size),
              "answer_accuracy": float(judged["correct"].mean()), "methods": rows,
              "_panels": panels}
    floor = served_floor(judged.get("floored", {}), n)  # served models: True/False tokens
    if floor:
        report["served_floor"] = floor
    if "plm" in judged:
        p_plm = _p(judged["plm"][test])
        report["reference_on_test"] = metrics.binary_report(p_plm, judged["correct"][test],
                                                            config.n_bins)
        report["agreement_rate"] = float(((_p(judged["plm"][cal]) > 0.5)
                                          == (_p(judged["polm"][cal]) > 0.5)).mean())
    return report


def fit_p_true(config, method: str):
    """Fit ``method`` on the calibration split; returns ``(fit, n_calibration, data_hash)``."""
    judged = open_qa_judgements(config)
    cal, _ = split_indices(len(judged["records"]), config.calibration_fraction, config.seed)
    if method == "platt":
        raise ConfigError("Platt scaling is compared by calm eval --compare but not written as "
                          "an adapter yet (it needs a shift on the true token); choose daca, "
                          "naive or ts")
    fit = _fit(method, judged, cal)
    if fit is None:
        raise ConfigError("vanilla is the uncalibrated baseline; choose daca, naive or ts")
    return fit, int(cal.size), dataset_hash(judged["records"])
