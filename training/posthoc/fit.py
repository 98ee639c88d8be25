"""Post-hoc calibration end to end: score, split, fit, compare, write the adapter.

``FitConfig`` names the models, data, mode and scoring variant; :func:`compare_methods`
fits every post-hoc method on the calibration split and evaluates all of them on the
held-out split (the table `calm eval` and the README's main job print);
:func:`fit_adapter` writes one method's calibration adapter (docs/methods.md §1–§3):

* cloze mode: the fitted temperature becomes ``answer_temperature`` (it acts on the
  option scores, so it cannot be fused into the LM head);
* letter mode: it becomes the token-level ``temperature`` (fusable), and vector scaling
  is written onto the option tokens' entries of ``tau``/``shift`` (exact, docs/methods.md §1).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from calm_runtime._fs import check_creatable
from calm_runtime.data.prompts import letter_tokens
from calm_runtime.data.sets import dataset_hash
from calm_runtime.errors import ConfigError, DataError, FitError
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_runtime.measure import metrics
from calm_runtime.modes import option_probabilities
from calm_training.methods import compared_methods, fit_method, option_method
from calm_training.posthoc import daca
from calm_training.posthoc.fit_config import (  # noqa: F401 - FitConfig and the names stay importable from here
    ALL_MODES,
    DEFAULT_VARIANT,
    LABEL_FREE,
    METHODS,
    FitConfig,
)
from calm_training.posthoc.fit_report import (  # noqa: F401 - the tables stay importable from here
    Metrics,
    add_selective,
    format_selective_table,
    format_table,
    served_floor,
)
from calm_training.posthoc.plan import FitPlan

__all__ = ["FitConfig", "METHODS", "LABEL_FREE", "DEFAULT_VARIANT", "compare_methods",
           "fit_adapter", "option_probabilities", "format_table", "format_selective_table"]

logger = logging.getLogger(__name__)


@dataclass
class _Prepared:
    records: list
    cal: np.ndarray  # indices into records (rows with the fit's option count)
    test: np.ndarray
    k: int
    polm: np.ndarray  # [N, K] option scores of the chosen variant
    plm: np.ndarray | None
    labels: np.ndarray
    #: {"model"/"reference": floored count} of served letter scoring (see served_floor)
    floored: dict = dataclasses.field(default_factory=dict)


def _prepare(plan: FitPlan, *, need_reference: bool, progress: bool) -> _Prepared:
    if need_reference:  # before any scoring
        plan.require_reference()
    records = plan.records
    polm_scores = plan.option_scores(adapter_dir=plan.config.adapter, progress=progress)
    plm_scores = plan.option_scores("reference", progress=progress) if need_reference else None
    n_options = polm_scores.n_options
    k = int(np.bincount(n_options).argmax())
    cal, test = plan.split
    keep = n_options == k
    dropped = int((~keep).sum())
    if dropped:
        logger.info("%d of %d records have a number of options other than %d; they are left "
                    "out of fitting and evaluation", dropped, len(records), k)
    return _Prepared(records=records, cal=cal[keep[cal]], test=test[keep[test]], k=k,
                     polm=polm_scores.scores(plan.variant())[:, :k],
                     plm=None if plm_scores is None else
                     plm_scores.scores(plan.variant("reference"))[:, :k],
                     labels=polm_scores.labels,
                     floored={role: scores.floored for role, scores in
                              (("model", polm_scores), ("reference", plm_scores))
                              if scores is not None and scores.floored is not None})


def _labeled(prep: _Prepared, idx: np.ndarray, what: str) -> np.ndarray:
    return require_labels(prep.labels[idx], what)


def require_labels(labels: np.ndarray, what: str) -> np.ndarray:
    """``labels`` unchanged, or a :class:`DataError` when some record has no answer."""
    if (labels < 0).any():
        raise DataError(f"{int((labels < 0).sum())} records of the {what} split have no answer; "
                        "labeled methods and metrics need an answer index on every record")
    return labels


def _fit(method: str, prep: _Prepared):
    """Fit ``method`` on the calibration split; returns the fit object (None for vanilla)."""
    fitted = option_method(method)
    labels = _labeled(prep, prep.cal, "calibration") if fitted.needs_labels else None
    reference = prep.plm[prep.cal] if fitted.needs_reference else None
    return fitted.fit_options(prep.polm[prep.cal], reference=reference, labels=labels)


def apply_fit(fit, scores: np.ndarray) -> np.ndarray:
    """Option probabilities of ``scores`` [N, K] under a fitted temperature or vector
    scaling (``None``: plain softmax)."""
    if fit is None:
        return option_probabilities(scores)
    if isinstance(fit, daca.VectorFit):
        return option_probabilities(scores * np.asarray(fit.weights) + np.asarray(fit.bias))
    return option_probabilities(scores, fit.temperature)


def metric_row(probs: np.ndarray, labels: np.ndarray, settings: Metrics):
    """One table row (metrics + ECE bootstrap interval) and its reliability-diagram panel."""
    row = metrics.calibration_report(probs, labels, settings.n_bins)
    conf, correct = probs.max(axis=1), (probs.argmax(axis=1) == labels).astype(float)
    add_selective(row, conf, correct, settings)
    return row, (conf, correct)


def _not_for_served(method: str, plan: FitPlan) -> str | None:
    """Why ``method`` is not fitted for a served model, else ``None``. Letter-mode vector
    scaling is not invariant to a shift of a question's scores, and an endpoint returns
    log-probabilities (logits minus a per-question constant) where the local path reads
    logits: the fit would depend on which one it saw (and a served model's adapter holds
    temperatures only)."""
    fitted = fit_method(method)
    if plan.mode.token_level and fitted.vector and plan.served:
        return ("not fitted for a served model: vector scaling is not shift-invariant and an "
                "endpoint returns log-probabilities, not logits; use daca, naive or ts")
    return None


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

        return compare_p_true(plan, compared_methods(plan.mode, reference=True, among=methods),
                              progress=progress)
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ConfigError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    need_reference = any(fit_method(m).needs_reference for m in methods)
    prep = _prepare(plan, need_reference=need_reference, progress=progress)
    labels = _labeled(prep, prep.test, "test")
    rows, panels = {}, {}
    for method in methods:
        reason = _not_for_served(method, plan)
        if reason:
            logger.warning("%s: %s", method, reason)
            rows[method] = {"error": reason}
            continue
        try:
            fit = _fit(method, prep)
        except FitError as exc:  # e.g. DACA without agreement: a result, not a crash
            logger.warning("%s: %s", method, exc)
            rows[method] = {"error": str(exc)}
            continue
        row, panels[method] = metric_row(apply_fit(fit, prep.polm[prep.test]), labels,
                                         plan.metrics)
        row["fit"] = None if fit is None else fit.to_dict()
        rows[method] = row
    report = {
        "config": config.to_dict(),
        "data_hash": dataset_hash(prep.records),
        "n_records": len(prep.records), "n_options": prep.k,
        "n_calibration": int(prep.cal.size), "n_test": int(prep.test.size),
        "methods": rows,
    }
    floor = served_floor(prep.floored, len(prep.records))
    if floor:
        report["served_floor"] = floor
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

    Returns the adapter and the fit report (calibration-split metrics before/after).
    """
    fitted = fit_method(method)
    if fitted.baseline:
        raise ConfigError(f"{fitted.refusal}; choose a method to fit: "
                          f"{', '.join(m for m in METHODS if fit_method(m).writes_adapter)}")
    if (Path(out).exists() or Path(out).is_symlink()) and not overwrite:
        raise ConfigError(f"{out} already exists; choose another --out or pass --overwrite")
    check_creatable(Path(out))  # before any scoring
    plan = FitPlan.resolve(config)
    plan.model.require_uncalibrated("an adapter fitted on its scores")
    if fitted.abstention:
        return _fit_threshold_adapter(plan, out, overwrite=overwrite, progress=progress)
    if not plan.mode.choice:
        return _fit_p_true_adapter(plan, method, out, overwrite=overwrite)
    if fitted.vector and plan.served:
        raise ConfigError(f"{method} writes per-token weights, which need the model's token "
                          "ids; a served model takes daca, naive or ts")
    prep = _prepare(plan, need_reference=fitted.needs_reference, progress=progress)
    fit = _fit(method, prep)
    _check_finite_temperature(fit)
    base, identity = plan.base
    adapter = dataclasses.replace(base, kind=_kind(base, fitted.kind), created_at=None)
    vanilla = prep.polm
    token_record = None
    if isinstance(fit, daca.VectorFit):
        _write_vector(adapter, fit, plan)
    elif not plan.mode.token_level:  # cloze: an answer temperature
        fit, token_record = _cloze_fits(plan, method, prep, base, adapter, fit, progress)
        adapter.answer_temperature = fit.temperature
    else:
        adapter.temperature = base.temperature * fit.temperature
    cal_metrics = {}
    if (prep.labels[prep.cal] >= 0).all():
        labels = prep.labels[prep.cal]
        cal_metrics = {"before": metrics.calibration_report(apply_fit(None, vanilla[prep.cal]),
                                                            labels, config.n_bins),
                       "after": metrics.calibration_report(apply_fit(fit, prep.polm[prep.cal]),
                                                           labels, config.n_bins)}
    adapter.method = {"name": method, "mode": config.mode, "variant": plan.recorded_variant,
                      "fit": fit.to_dict(), "settings": config.to_dict()}
    if token_record is not None:
        adapter.method["token_fit"] = token_record
    adapter.metrics = {"calibration_split": cal_metrics}
    adapter.provenance = _provenance(plan, identity, fitted, data_hash=dataset_hash(prep.records),
                                     n_calibration=int(prep.cal.size))
    adapter.provenance["base_adapter"] = base.kind if config.adapter else None
    # how the prompts reached the model (chat template or text): the format the calibration
    # holds for
    adapter.provenance["prompt_format"] = plan.prompt_format
    floor = served_floor(prep.floored, len(prep.records))
    if floor:
        adapter.provenance["served_floor"] = floor
    adapter.validate()
    adapter.save_pretrained(out, overwrite=overwrite)
    return adapter, {"fit": fit.to_dict(), "calibration_split": cal_metrics,
                     "token_fit": token_record}


def _provenance(plan: FitPlan, identity, fitted, *, data_hash: str, n_calibration: int) -> dict:
    """What an adapter records of where it came from: the model, the reference (label-free
    methods), the data and the calibration split."""
    return {"model": identity.to_dict(),
            "reference": plan.reference.identity().to_dict() if fitted.needs_reference else None,
            "data": plan.config.data, "data_hash": data_hash,
            "split": {"part": "calibration", "fraction": plan.config.calibration_fraction,
                      "seed": plan.config.seed, "n": n_calibration}}


def _cloze_fits(plan: FitPlan, method: str, prep: _Prepared, base: CalibrationAdapter,
                adapter: CalibrationAdapter, fit, progress: bool):
    """Cloze mode: the token-level temperature (what the engine's head carries, when a signal
    exists: docs/methods.md §3 "Token level"), then the option-level fit on the option
    scores of the token-calibrated model, which is what the runtime reads. Returns the
    option-level fit and the token fit's record (set on ``adapter.temperature`` in place)."""
    from calm_training.posthoc.token_fit import cloze_token_temperature

    cal = prep.cal
    chosen = prep.polm[cal].argmax(1)
    agree = None if prep.plm is None else prep.plm[cal].argmax(1) == chosen
    labels = prep.labels[cal] if (prep.labels[cal] >= 0).all() else None
    token_fit, record = cloze_token_temperature(
        method, model=plan.model, reference=plan.reference,
        records=[prep.records[i] for i in cal], chosen=chosen, agree=agree, labels=labels,
        base_adapter=base if plan.config.adapter else None, batch_size=plan.config.batch_size,
        max_length=plan.config.max_length, progress=progress)
    if token_fit is not None and token_fit.at_bound is not None:
        record = {**record, "fitted": False,
                  "reason": f"the token-level optimum is at a bound ({token_fit.at_bound}): "
                            "the answer positions carry no usable signal"}
        token_fit = None
    if token_fit is None:
        logger.info("token log-probabilities stay uncalibrated: %s", record["reason"])
        return fit, record
    adapter.temperature = base.temperature * token_fit.temperature
    logger.info("token-level %s temperature %.4g on %d answer positions; refitting the "
                "option-level temperature on the token-calibrated scores", token_fit.method,
                token_fit.temperature, record["positions"])
    import tempfile

    with tempfile.TemporaryDirectory(prefix="calm-token-") as tmp:
        staged = dataclasses.replace(base, temperature=adapter.temperature, created_at=None)
        staged.save_pretrained(Path(tmp) / "adapter")
        scores = plan.option_scores(adapter_dir=Path(tmp) / "adapter", progress=progress)
    prep.polm = scores.scores(plan.variant())[:, :prep.k]
    fit = _fit(method, prep)
    _check_finite_temperature(fit)
    return fit, record


def _fit_threshold_adapter(plan: FitPlan, out, *, overwrite: bool, progress: bool):
    """``calm fit threshold``: the base adapter (``--adapter``, else the identity) with
    the abstention threshold chosen on the calibration split; the test split's coverage and
    selective risk at that threshold are reported (and recorded) beside it."""
    from calm_training.posthoc.threshold import fit_threshold

    config = plan.config
    if not plan.mode.choice:
        raise ConfigError("calm fit threshold works on multiple-choice answers; use cloze or "
                          "letter mode")
    prep = _prepare(plan, need_reference=False, progress=progress)
    base, identity = plan.base
    scores = prep.polm
    if identity.served is not None and plan.mode.token_level:  # no engine to fuse T into
        scores = scores / base.temperature
    t_ans = plan.mode.answer_temperature(base.answer_temperature)
    probs = option_probabilities(scores, t_ans)
    conf = probs.max(axis=1)
    labels = _labeled(prep, prep.cal, "calibration")
    fit = fit_threshold(conf[prep.cal], (probs[prep.cal].argmax(1) == labels).astype(float),
                        risk=config.risk, confidence=config.risk_confidence)
    test = {}
    if (prep.labels[prep.test] >= 0).all() and prep.test.size:
        kept = conf[prep.test] >= fit.threshold
        right = probs[prep.test].argmax(1) == prep.labels[prep.test]
        test = {"n": int(prep.test.size), "coverage": float(kept.mean()),
                "selective_risk": (float(1 - right[kept].mean()) if kept.any() else None),
                "risk_without_abstention": float(1 - right.mean())}
    adapter = dataclasses.replace(
        base, created_at=None,
        abstention={**fit.to_dict(), "mode": config.mode, "variant": plan.recorded_variant,
                    "data": config.data, "test_split": test})
    if not config.adapter:
        adapter.method = {"name": "threshold", "mode": config.mode,
                          "variant": plan.recorded_variant, "settings": config.to_dict()}
    adapter.save_pretrained(out, overwrite=overwrite)
    return adapter, {"fit": fit.to_dict(), "test_split": test}


def _fit_p_true_adapter(plan: FitPlan, method: str, out, *, overwrite: bool):
    from calm_runtime.data.prompts import p_true_template
    from calm_training.posthoc.p_true import fit_p_true

    config = plan.config
    if config.adapter:
        raise ConfigError("P(True) fits on top of another adapter are not supported yet; fit "
                          "without --adapter")
    fitted = fit_method(method)
    fit, n_cal, data_hash = fit_p_true(plan, method)
    _check_finite_temperature(fit)
    base, identity = plan.base
    adapter = dataclasses.replace(base, kind=_kind(base, fitted.kind) + "_p_true",
                                  created_at=None)
    adapter.temperature = base.temperature * fit.temperature
    adapter.p_true_template = p_true_template(config.p_true_template).to_dict()
    adapter.method = {"name": method, "mode": "p_true", "fit": fit.to_dict(),
                      "settings": config.to_dict()}
    adapter.provenance = _provenance(plan, identity, fitted, data_hash=data_hash,
                                     n_calibration=n_cal)
    adapter.save_pretrained(out, overwrite=overwrite)
    return adapter, {"fit": fit.to_dict(), "calibration_split": {}}


def _kind(base: CalibrationAdapter, name: str) -> str:
    return name if base.kind == "identity" else f"{base.kind}+{name}"


def _check_finite_temperature(fit) -> None:
    if isinstance(fit, daca.TemperatureFit) and not np.isfinite(fit.temperature):
        raise FitError(f"the {fit.method} fit put the optimum at an infinite temperature on "
                       f"{fit.n_used} items (uniform probabilities fit best: the scores carry no "
                       "signal there); use more or other data; nothing was written")


def _write_vector(adapter: CalibrationAdapter, fit, plan: FitPlan) -> None:
    if not plan.mode.token_level:
        raise ConfigError("vector scaling of cloze scores acts on summed log-probabilities and "
                          "cannot be stored as token calibration; use daca or ts in cloze mode, "
                          "or letter mode for vector scaling")
    if (adapter.tau != 1).any() or (adapter.shift != 0).any():
        raise ConfigError("vector scaling on top of an adapter that already has per-token tau/"
                          "shift is not supported; fit a scalar temperature (daca or ts)")
    from transformers import AutoTokenizer

    from calm_training.scoring.local import single_token_id, uses_chat_template

    tokenizer = AutoTokenizer.from_pretrained(str(plan.model.folder()))
    chat = uses_chat_template(tokenizer, plan.config.chat)
    ids = [single_token_id(tokenizer, t) for t in letter_tokens(len(fit.weights), chat=chat)]
    tau, shift = daca.vector_fit_to_tau_shift(fit, ids, adapter.base_model.vocab_size,
                                              temperature=adapter.temperature)
    adapter.tau, adapter.shift = tau, shift
