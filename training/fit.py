"""Post-hoc calibration end to end: score, split, fit, compare, write the adapter.

``FitConfig`` names the models, data, mode and scoring variant; :func:`compare_methods`
fits every post-hoc method on the calibration split and evaluates all of them on the
held-out split (the table `calm eval` and the README's main job print);
:func:`fit_adapter` writes one method's calibration adapter (docs/methods.md §1–§3): the
run is resolved once (:class:`~calm_training.posthoc.plan.FitPlan`), and the method
(:mod:`calm_training.methods`) fits over it and writes what the scoring mode reads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from calm_runtime.errors import ConfigError, FitError
from calm_runtime.files import check_creatable
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_runtime.measure import metrics
from calm_runtime.modes import option_probabilities
from calm_training.methods import (
    LABEL_FREE,
    METHODS,
    compared_methods,
    fit_method,
    method_for_mode,
    option_method,
    p_true_method,
)
from calm_training.posthoc.fit_config import (
    DEFAULT_VARIANT,
    FitConfig,
)
from calm_training.posthoc.fit_report import (
    format_selective_table,
    format_table,
)
from calm_training.posthoc.option_fit import apply_fit, metric_row, prepare
from calm_training.posthoc.plan import FitPlan

__all__ = ["FitConfig", "METHODS", "LABEL_FREE", "DEFAULT_VARIANT", "compare_methods",
           "fit_adapter", "option_probabilities", "format_table", "format_selective_table"]

logger = logging.getLogger(__name__)


def compare_methods(config: FitConfig, methods: Sequence[str] = METHODS, *,
                    progress: bool = True) -> dict:
    """Fit ``methods`` on the calibration split, evaluate all on the test split.

    Returns a JSON-ready report: the config, split sizes, the reference model's own
    calibration, and one row per method with accuracy, ECE (+ 95% bootstrap interval),
    MCE, AECE, Brier, NLL and the fitted parameters.
    """
    plan = FitPlan.resolve(config)
    if not plan.mode.choice:  # P(True)
        from calm_training.posthoc.p_true import compare_p_true

        names = compared_methods(plan.mode, reference=True, among=methods)
        return compare_p_true(plan, [p_true_method(m) for m in names], progress=progress)
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ConfigError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    chosen = [option_method(m) for m in methods]
    prep = prepare(plan, need_reference=any(m.needs_reference for m in chosen),
                   progress=progress)
    labels = prep.labeled(prep.test, "test")
    rows, panels = {}, {}
    for method in chosen:
        name = method.name
        reason = method.not_fitted_because(plan)
        if reason:
            logger.warning("%s: %s", name, reason)
            rows[name] = {"error": reason}
            continue
        try:
            fit = method.fit_prepared(prep)
        except FitError as exc:  # e.g. DACA without agreement: a result, not a crash
            logger.warning("%s: %s", name, exc)
            rows[name] = {"error": str(exc)}
            continue
        row, panels[name] = metric_row(apply_fit(fit, prep.polm[prep.test]), labels,
                                       plan.metrics)
        row["fit"] = None if fit is None else fit.to_dict()
        rows[name] = row
    report = {
        "config": config.to_dict(),
        "data_hash": plan.data_hash,
        "n_records": len(prep.records), "n_options": prep.k,
        "n_calibration": int(prep.cal.size), "n_test": int(prep.test.size),
        "methods": rows,
    }
    if prep.served_floor:
        report["served_floor"] = prep.served_floor
    if prep.plm is not None:
        plm_probs = option_probabilities(prep.plm[prep.test])
        report["reference_on_test"] = metrics.calibration_report(plm_probs, labels, config.n_bins)
        agree = prep.plm[prep.cal].argmax(1) == prep.polm[prep.cal].argmax(1)
        report["agreement_rate"] = float(agree.mean())
    report["_panels"] = panels  # for the reliability diagram; dropped before JSON
    return report


def fit_adapter(config: FitConfig, method: str, out: str | Path, *, overwrite: bool = False,
                progress: bool = True) -> tuple[CalibrationAdapter, dict]:
    """Fit ``method`` and write its calibration adapter to ``out`` (atomically).

    Returns the adapter and the fit report (the fit, and the calibration split's metrics
    before/after or, for an abstention threshold, the test split's coverage and risk).
    """
    named = fit_method(method)
    if named.baseline:
        raise ConfigError(f"{named.refusal}; choose a method to fit: "
                          f"{', '.join(m for m in METHODS if fit_method(m).writes_adapter)}")
    if (Path(out).exists() or Path(out).is_symlink()) and not overwrite:
        raise ConfigError(f"{out} already exists; choose another --out or pass --overwrite")
    check_creatable(Path(out))  # before any scoring
    plan = FitPlan.resolve(config)
    plan.model.require_uncalibrated("an adapter fitted on its scores")
    fitted = method_for_mode(method, plan.mode)
    fitted.check_writable(plan)  # before any scoring, too
    result = fitted.fit(plan, progress=progress)
    adapter = fitted.write(plan, result)
    adapter.save_pretrained(out, overwrite=overwrite)
    return adapter, result.report
