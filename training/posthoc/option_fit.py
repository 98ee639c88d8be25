"""Option-level fitting over a :class:`~calm_training.posthoc.plan.FitPlan`: the scores a
fit reads (:func:`prepare`: the calibration and test splits of the records with the fit's
option count, the model's and the reference's option scores), what a fit does to option
scores (:func:`apply_fit`), one metrics row (:func:`metric_row`) and the cloze token fit
(:func:`cloze_token_fit`). The methods of :mod:`calm_training.methods` fit on these; nothing
here looks a method up by its name.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from calm_runtime.calibration import TEMPERATURE_RANGE
from calm_runtime.errors import DataError, FitError
from calm_runtime.measure import metrics
from calm_runtime.modes import option_probabilities
from calm_runtime.temperature import TemperatureFit
from calm_training.posthoc.fit_report import Metrics, add_selective, served_floor
from calm_training.posthoc.plan import FitPlan

__all__ = ["Prepared", "apply_fit", "check_finite_temperature", "check_score_spread",
           "check_usable_temperature", "cloze_token_fit", "metric_row", "prepare",
           "require_labels", "rescored"]

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    """The option scores a fit reads and the split it reads them on."""

    records: list
    cal: np.ndarray  # indices into records (rows with the fit's option count)
    test: np.ndarray
    k: int
    polm: np.ndarray  # [N, K] option scores of the chosen variant
    plm: np.ndarray | None
    labels: np.ndarray
    #: {"model"/"reference": floored count} of served letter scoring (see served_floor)
    floored: dict = dataclasses.field(default_factory=dict)
    #: letter mode, local or engine scores: the model's token id of each option letter
    option_ids: np.ndarray | None = None

    @property
    def served_floor(self) -> dict | None:
        """How many of the records a served model's letter scores floored, per role
        (:func:`~calm_training.posthoc.fit_report.served_floor`); None when none was."""
        return served_floor(self.floored, len(self.records))

    def labeled(self, idx: np.ndarray, what: str) -> np.ndarray:
        """The answers of rows ``idx`` (the ``what`` split), or a :class:`DataError` when one
        is missing."""
        return require_labels(self.labels[idx], what)

    def calibration_labels(self) -> np.ndarray | None:
        """The calibration split's answers, or ``None`` when some record has none."""
        labels = self.labels[self.cal]
        return labels if (labels >= 0).all() else None


def prepare(plan: FitPlan, *, need_reference: bool, progress: bool) -> Prepared:
    """The model's (and, when ``need_reference``, the reference's) option scores of the
    plan's records, with the ``--adapter``'s calibration applied while scoring; the records
    whose option count is not the most common one are left out."""
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
    return Prepared(records=records, cal=cal[keep[cal]], test=test[keep[test]], k=k,
                    polm=polm_scores.scores(plan.variant())[:, :k],
                    plm=None if plm_scores is None else
                    plm_scores.scores(plan.variant("reference"))[:, :k],
                    labels=polm_scores.labels,
                    floored={role: scores.floored for role, scores in
                             (("model", polm_scores), ("reference", plm_scores))
                             if scores is not None and scores.floored is not None},
                    option_ids=(None if polm_scores.option_ids is None
                                else polm_scores.option_ids[:k]))


def require_labels(labels: np.ndarray, what: str) -> np.ndarray:
    """``labels`` unchanged, or a :class:`DataError` when some record has no answer."""
    if (labels < 0).any():
        raise DataError(f"{int((labels < 0).sum())} records of the {what} split have no answer; "
                        "labeled methods and metrics need an answer index on every record")
    return labels


def apply_fit(fit, scores: np.ndarray) -> np.ndarray:
    """Option probabilities of ``scores`` [N, K] under a fitted temperature or vector
    scaling (``None``: plain softmax; a vector fit,
    :class:`~calm_training.methods.vector.VectorFit`, scales them itself)."""
    if fit is None:
        return option_probabilities(scores)
    if isinstance(fit, TemperatureFit):
        return option_probabilities(scores, fit.temperature)
    return option_probabilities(fit.scaled(scores))


def metric_row(probs: np.ndarray, labels: np.ndarray, settings: Metrics):
    """One table row (metrics + ECE bootstrap interval) and its reliability-diagram panel."""
    row = metrics.calibration_report(probs, labels, settings.n_bins)
    conf, correct = probs.max(axis=1), (probs.argmax(axis=1) == labels).astype(float)
    add_selective(row, conf, correct, settings)
    return row, (conf, correct)


def check_finite_temperature(fit) -> None:
    """A :class:`FitError` when a temperature fit ran off to infinity (no signal)."""
    if isinstance(fit, TemperatureFit) and not np.isfinite(fit.temperature):
        raise FitError(f"the {fit.method} fit put the optimum at an infinite temperature on "
                       f"{fit.n_used} items (uniform probabilities fit best: the scores carry no "
                       "signal there); use more or other data; nothing was written")


def _spread(scores: np.ndarray) -> np.ndarray:
    """Per row of ``scores`` [N, K], the largest minus the smallest finite score."""
    finite = np.where(np.isfinite(scores), scores, np.nan)
    with np.errstate(invalid="ignore"):
        return np.nan_to_num(np.nanmax(finite, axis=1) - np.nanmin(finite, axis=1))


def _where_scores(plan: FitPlan) -> str:
    return ("the lm-eval log's filtered_resps (each option's log-likelihood)"
            if plan.score_logs else "how the options were scored (mode, variant, model)")


def check_score_spread(plan: FitPlan, prep: Prepared) -> None:
    """A :class:`FitError`, before fitting, when the model's scores do not differ between
    the options of any calibration question: no temperature changes such scores."""
    spread = _spread(prep.polm[prep.cal])
    if spread.size and not (spread > 0).any():
        raise FitError(f"the model's option scores are the same for every option of all "
                       f"{spread.size} calibration questions, so no temperature can be fitted "
                       f"to them; check {_where_scores(plan)}; nothing was written")


def check_usable_temperature(fit, plan: FitPlan, prep: Prepared) -> None:
    """:func:`check_finite_temperature`, and a :class:`FitError` naming the scores' spread
    when a temperature fit ends outside the range an adapter holds
    (:data:`~calm_runtime.calibration.TEMPERATURE_RANGE`): that is what the data gives, not
    something fitting again can change."""
    check_finite_temperature(fit)
    low, high = TEMPERATURE_RANGE
    if not isinstance(fit, TemperatureFit) or low <= fit.temperature <= high:
        return
    model = float(np.median(_spread(prep.polm[prep.cal])))
    spread = f"the model's option scores differ by a median of {model:.3g} between a question's "
    spread += "options"
    if prep.plm is not None:
        spread += f" (the reference's by {float(np.median(_spread(prep.plm[prep.cal]))):.3g})"
    bound = f" (at the {fit.at_bound.replace('_', ' ')} bound)" if fit.at_bound else ""
    raise FitError(f"the {fit.method} fit put the answer temperature at "
                   f"{fit.temperature:.3g}{bound}, outside the [{low:g}, {high:g}] an adapter "
                   f"holds: on the {fit.n_used} questions it fitted, {spread}, a scale no "
                   f"usable temperature maps to confidences; check {_where_scores(plan)}; "
                   "nothing was written")


def cloze_token_fit(method, plan: FitPlan, prep: Prepared, *, progress: bool):
    """Cloze mode's token-level temperature for ``method`` (a
    :class:`~calm_training.methods.fit_method.FitMethod`): what the engine's head carries,
    when a signal exists (docs/methods.md §3 "Token level"). Returns ``(temperature or None,
    record)``: the fitted temperature (to multiply into the base adapter's) and what was
    fitted on which signal, or why nothing was."""
    from calm_training.posthoc.token_fit import cloze_token_temperature

    base, _ = plan.base
    cal = prep.cal
    chosen = prep.polm[cal].argmax(1)
    agree = None if prep.plm is None else prep.plm[cal].argmax(1) == chosen
    token_fit, record = cloze_token_temperature(
        method, model=plan.model, reference=plan.reference,
        records=[prep.records[i] for i in cal], chosen=chosen, agree=agree,
        labels=prep.calibration_labels(), base_adapter=base if plan.config.adapter else None,
        batch_size=plan.config.batch_size, max_length=plan.config.max_length,
        progress=progress)
    if token_fit is not None and token_fit.at_bound is not None:
        record = {**record, "fitted": False,
                  "reason": f"the token-level optimum is at a bound ({token_fit.at_bound}): "
                            "the answer positions carry no usable signal"}
        token_fit = None
    if token_fit is None:
        logger.info("token log-probabilities stay uncalibrated: %s", record["reason"])
        return None, record
    logger.info("token-level %s temperature %.4g on %d answer positions; refitting the "
                "option-level temperature on the token-calibrated scores", token_fit.method,
                token_fit.temperature, record["positions"])
    return token_fit.temperature, record


def rescored(plan: FitPlan, prep: Prepared, temperature: float, *, progress: bool) -> Prepared:
    """``prep`` with the model's option scores read again with the token ``temperature``
    (the base adapter's times the token fit's) applied while scoring: what the runtime
    reads once the engine's head carries it."""
    base, _ = plan.base
    with tempfile.TemporaryDirectory(prefix="calm-token-") as tmp:
        staged = dataclasses.replace(base, temperature=temperature, created_at=None)
        staged.save_pretrained(Path(tmp) / "adapter")
        scores = plan.option_scores(adapter_dir=Path(tmp) / "adapter", progress=progress)
    return dataclasses.replace(prep, polm=scores.scores(plan.variant())[:, :prep.k])
