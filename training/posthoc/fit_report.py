"""The fit report's figures and tables: selective-prediction metrics, served-score floors,
and the Markdown tables ``calm fit`` / ``calm eval`` print (shared by the multiple-choice
and the P(True) fits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from calm_runtime import modes
from calm_runtime.measure import metrics

__all__ = ["Metrics", "add_selective", "format_selective_table", "format_table",
           "paired_ece_difference", "readings", "served_floor"]


@dataclass(frozen=True)
class Metrics:
    """How a report's metrics are computed: ECE/MCE/AECE bins and bootstrap resamples."""

    n_bins: int = 10
    bootstrap: int = 1000


def served_floor(floored: dict, n: int) -> dict | None:
    """``{"model"/"reference": {"floored", "n", "share"}}`` from the count of each served
    model's questions (of ``n``) where a scored token (an option letter, True/False) got the
    floor: the smallest returned log-probability, an upper bound, which bounds the error of
    those scores. ``None`` when no served model was scored that way."""
    if not floored:
        return None
    return {role: {"floored": int(count), "n": n, "share": count / n if n else 0.0}
            for role, count in floored.items()}


def add_selective(row: dict, conf: np.ndarray, correct: np.ndarray, settings: Metrics) -> None:
    """The ECE's bootstrap interval, the selective-prediction metrics (AUROC, AURC and PRR
    with bootstrap intervals; selective accuracy and coverage per threshold) and the
    per-question ``confidence`` and ``correct``
    arrays, so that every figure of a report can be recomputed from it."""
    if settings.bootstrap:
        row["ece_ci95"] = list(metrics.bootstrap_interval(
            lambda c, y: metrics.ece(c, y, settings.n_bins), conf, correct,
            n_resamples=settings.bootstrap))
    row.update(_finite_or_none(metrics.selective_report(conf, correct,
                                                        bootstrap=settings.bootstrap)))
    row["confidence"] = [float(c) for c in conf]
    row["correct"] = [int(c) for c in correct]


def _finite_or_none(value):
    """NaN (an undefined metric: AUROC without a wrong answer) as None, for strict JSON."""
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def format_table(report: dict) -> str:
    """The comparison as a Markdown table (metrics on the test split)."""
    cfg = report["config"]
    ref_variant = cfg.get("reference_variant")
    head = (f"{cfg['model']} on {cfg['data']} ({cfg['mode']}"
            + (f", {cfg['variant']} scores" if not modes.mode(cfg["mode"]).token_level else "")
            + (f", reference {ref_variant} scores" if ref_variant else "")
            + f"), test n={report['n_test']}"
            + (f", fit n={report['n_calibration']}" if report.get("n_calibration") else "")
            + f", {cfg['n_bins']} bins")
    if "agreement_rate" in report:
        ref = report["reference_on_test"]
        head += (f"; reference {cfg['reference']}: agreement {report['agreement_rate']:.2f}, "
                 f"own ECE {ref['ece']:.3f}")
    if "answer_accuracy" in report:
        head += f"; answer accuracy {report['answer_accuracy']:.3f}"
    for role, floor in report.get("served_floor", {}).items():
        head += (f"; served {role}: {floor['floored']} of {floor['n']} questions with a token "
                 "at the floor (an upper bound)")
    lines = [head, "",
             "| method | T | acc | ECE [95% CI] | MCE | AECE | Brier | NLL | AUROC | AURC |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in report["methods"].items():
        if "error" in row:
            failed = "" if row["error"].startswith("not fitted") else "fit failed: "
            lines.append(f"| {name} | - | {failed}{row['error']} | - | - | - | - | - | - "
                         "| - |")
            continue
        fit = row.get("fit") or {}
        temp = fit.get("temperature")
        t_text = "vector" if "weights" in fit else ("1" if not fit else
                                                     ("inf" if temp is None else f"{temp:.3f}"))
        if fit.get("alpha"):
            t_text = f"α, {t_text}"
        ci = row.get("ece_ci95")
        ece_text = f"{row['ece']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
        lines.append(f"| {name} | {t_text} | {row['accuracy']:.3f} | {ece_text} | "
                     f"{row['mce']:.3f} | {row['aece']:.3f} | {row['brier']:.3f} | "
                     f"{row['nll']:.3f} | {_number(row.get('auroc'))} | "
                     f"{_number(row.get('aurc'))} |")
    return "\n".join(lines)


def format_selective_table(report: dict, thresholds=(0.5, 0.6, 0.7, 0.8, 0.9)) -> str:
    """Selective accuracy per method: the accuracy of the answers kept at each confidence
    threshold, with the share kept (coverage) in parentheses."""
    lines = ["| method | " + " | ".join(f"conf >= {t}" for t in thresholds) + " |",
             "|---|" + "---|" * len(thresholds)]
    for name, row in report["methods"].items():
        rows = {round(r["threshold"], 4): r for r in row.get("selective") or []}
        cells = []
        for t in thresholds:
            r = rows.get(round(t, 4))
            cells.append("-" if r is None else
                         f"{_number(r['accuracy'])} ({r['coverage']:.2f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _number(value) -> str:
    return "-" if value is None else f"{value:.3f}"


#: the confidence below which a method keeps no answer in the selective table's first column
SELECTIVE_FLOOR = 0.5


def readings(report: dict, *, n_resamples: int = 2000, seed: int = 0) -> list[str]:
    """What the comparison table supports, in plain lines, decided by intervals: each
    calibrated method's ECE against vanilla's, naive alignment's against DACA's (paired
    bootstrap over the test questions, 95%); vector variants that change answers; methods
    whose confidences never reach the selective table's first threshold. A difference whose
    interval holds 0 is said to be undecided by this data, never read as a winner."""
    rows = {name: row for name, row in report["methods"].items()
            if "error" not in row and row.get("confidence")}
    n_bins = report["config"]["n_bins"]
    lines = []
    pairs = [(name, "vanilla") for name in rows if name != "vanilla"]
    if "naive" in rows and "daca" in rows:
        pairs.append(("naive", "daca"))
    for a, b in pairs:
        if b not in rows:
            continue
        delta, low, high = paired_ece_difference(rows[a], rows[b], n_bins,
                                                 n_resamples=n_resamples, seed=seed)
        if low > 0 or high < 0:
            word = "lower" if high < 0 else "higher"
            verdict = f"{a}'s ECE is {word} than {b}'s"
        else:
            verdict = f"this data cannot tell {a} from {b} (the interval holds 0)"
        lines.append(f"ECE {a} - {b}: {delta:+.3f} [{low:+.3f}, {high:+.3f}]: {verdict}")
    for name, row in rows.items():
        scalar = name.removesuffix("-vector")
        if scalar != name and scalar in rows and abs(row["accuracy"]
                                                     - rows[scalar]["accuracy"]) >= 0.005:
            lines.append(f"{name} changes answers (accuracy {rows[scalar]['accuracy']:.3f} -> "
                         f"{row['accuracy']:.3f}): a vector fit scales each option position "
                         f"on its own, so the most probable option can change; {scalar} never "
                         "changes an answer")
        top = max(row["confidence"])
        if top < SELECTIVE_FLOOR:
            lines.append(f"{name} keeps no answer at confidence >= {SELECTIVE_FLOOR} (its "
                         f"highest is {top:.3f}): its probabilities are nearly uniform, so the "
                         "selective table has no row for it")
    if lines:
        lines.insert(0, f"reading (paired bootstrap over the {report['n_test']} test "
                        "questions, 95%):")
    return lines


def paired_ece_difference(a: dict, b: dict, n_bins: int, *, n_resamples: int = 2000,
                          seed: int = 0) -> tuple[float, float, float]:
    """ECE(a) − ECE(b) on the same questions and its basic bootstrap 95% interval (questions
    resampled once for both sides; a basic interval's verdict does not improve with a
    skewed, imprecise bootstrap distribution as a percentile interval's can)."""
    def difference(ca, ya, cb, yb) -> float:
        return metrics.ece(ca, ya, n_bins) - metrics.ece(cb, yb, n_bins)

    arrays = (np.asarray(a["confidence"]), np.asarray(a["correct"], dtype=float),
              np.asarray(b["confidence"]), np.asarray(b["correct"], dtype=float))
    delta = difference(*arrays)
    q_low, q_high = metrics.bootstrap_interval(difference, *arrays, n_resamples=n_resamples,
                                               seed=seed)  # the same rows for both sides
    return float(delta), float(2 * delta - q_high), float(2 * delta - q_low)
