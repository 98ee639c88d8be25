"""Open QA: greedy answers, correctness by alias match, P(True), and its calibration.

docs/methods.md §2–§3: the post-trained model answers each question greedily; each model
(PoLM and, for DACA, the PLM) judges that answer with a named P(True) template; the
two-way ``[true, false]`` logits (calm_training.scoring.judgements, read through
:meth:`FitPlan.judgements <calm_training.posthoc.plan.FitPlan.judgements>`) are calibrated
like option logits (DACA on the two-way
distributions, or temperature scaling against answer correctness). The fitted
temperature is token-level, so it fuses into the engine's LM head.
"""

from __future__ import annotations

import logging

from calm_runtime.errors import FitError
from calm_runtime.measure import metrics
from calm_runtime.modes import p_true_probability
from calm_training.posthoc.fit_report import add_selective, served_floor
from calm_training.posthoc.plan import FitPlan

__all__ = ["compare_p_true"]

logger = logging.getLogger(__name__)


def compare_p_true(plan: FitPlan, methods, *, progress: bool = True) -> dict:
    """Fit the P(True) calibrations ``methods`` (:class:`~calm_training.methods.fit_method.
    FitMethod` objects) on the calibration split; binary metrics on the test split.

    The label of an item is whether the PoLM's answer is correct; the confidence is
    P(True) (docs/methods.md §5).
    """
    judged = plan.judgements(progress=progress)
    n = len(judged["records"])
    cal, test = plan.split
    settings = plan.metrics
    rows, panels = {}, {}
    for method in methods:
        try:
            fit = method.fit_judgements(judged, cal)
        except FitError as exc:  # e.g. no wrong answer to fit against: a result, not a crash
            logger.warning("%s: %s", method.name, exc)
            rows[method.name] = {"error": str(exc)}
            continue
        p = method.p_true_probabilities(fit, judged["polm"][test])
        y = judged["correct"][test]
        row = metrics.binary_report(p, y, settings.n_bins)
        add_selective(row, p, y, settings)
        row["fit"] = None if fit is None else fit.to_dict()
        rows[method.name], panels[method.name] = row, (p, y)
    report = {"config": plan.config.to_dict(), "data_hash": plan.data_hash,
              "n_records": n, "n_calibration": int(cal.size), "n_test": int(test.size),
              "answer_accuracy": float(judged["correct"].mean()), "methods": rows,
              "_panels": panels}
    floor = served_floor(judged.get("floored", {}), n)  # served models: True/False tokens
    if floor:
        report["served_floor"] = floor
    if "plm" in judged:
        p_plm = p_true_probability(judged["plm"][test])
        report["reference_on_test"] = metrics.binary_report(p_plm, judged["correct"][test],
                                                            settings.n_bins)
        agree = ((p_true_probability(judged["plm"][cal]) > 0.5)
                 == (p_true_probability(judged["polm"][cal]) > 0.5))
        report["agreement_rate"] = float(agree.mean())
    return report
