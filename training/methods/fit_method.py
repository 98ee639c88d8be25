"""A post-hoc method of ``calm fit`` / ``calm eval --compare`` (docs/methods.md §3): what it
needs, what it fits on and what it writes.

A :class:`FitMethod` declares what it needs (a reference model, labels), whether it has a
token-level counterpart and where it is fitted (option scores, P(True)'s two-way logits);
:meth:`FitMethod.fit` fits it over a :class:`~calm_training.posthoc.plan.FitPlan` and
:meth:`FitMethod.write` puts the result on an adapter. What a fit writes depends on the
scoring mode (:class:`calm_runtime.modes.Mode`), never on a method's name:

* cloze: the option-level temperature becomes ``answer_temperature`` (it acts on summed
  option scores, so it cannot be fused into the LM head), after a token-level temperature
  where the answer positions carry a signal;
* letter: the temperature is token-level (fusable);
  :class:`~calm_training.methods.vector.VectorMethod` writes vector scaling onto the option
  tokens' entries of ``tau``/``shift`` (exact, docs/methods.md §1);
* P(True): the temperature of the two-way ``[true, false]`` logits, with the template.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from calm_runtime.errors import ConfigError
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_runtime.measure import metrics
from calm_runtime.modes import p_true_probability
from calm_training.posthoc.option_fit import (
    Prepared,
    apply_fit,
    check_finite_temperature,
    check_score_spread,
    check_usable_temperature,
    cloze_token_fit,
    prepare,
    rescored,
)
from calm_training.posthoc.plan import FitPlan

__all__ = ["SETTINGS", "FitMethod", "Fitted", "add_arguments"]

#: the :class:`~calm_training.posthoc.fit_config.FitConfig` setting the token-level fit of the
#: temperature methods (``daca``, ``naive``, ``ts``; :meth:`FitMethod.fit`) reads, set by the
#: flag :func:`add_arguments` declares
SETTINGS = ("token_fit",)


@dataclass
class Fitted:
    """One fit over a plan: the fit, what the adapter records of it and the report
    ``calm fit`` prints."""

    fit: object
    #: what ``fit_adapter`` returns: the fit, and the calibration split's metrics (or, for
    #: an abstention threshold, the test split's coverage and risk)
    report: dict
    n_calibration: int = 0
    #: calibration-split metrics before/after (labeled data only)
    calibration_split: dict = field(default_factory=dict)
    #: cloze: the token-level temperature fitted (None: none) and its record
    token_temperature: float | None = None
    token_record: dict | None = None
    #: served letter scoring: how many questions got the floor (Prepared.served_floor)
    served_floor: dict | None = None
    #: an abstention threshold's coverage and risk on the test split
    test_split: dict | None = None
    #: letter mode: the token id each option letter was scored at (OptionScores.option_ids)
    option_ids: np.ndarray | None = None


@dataclass(frozen=True)
class FitMethod:
    """One post-hoc method of ``calm fit`` / ``calm eval --compare``."""

    name: str
    #: label-free: fitted against a pre-trained reference model's scores (``--reference``)
    needs_reference: bool = False
    #: fitted against the calibration split's answers
    needs_labels: bool = False
    #: DACA's agreement mask (naive: every question, no mask)
    masked: bool = False
    #: fits on option scores ``[N, K]``: ``(reference, scores)`` label-free, else
    #: ``(scores, labels)``; None: not an option-level method (or the unfitted baseline)
    option_fit: Callable | None = None
    #: fits on P(True)'s ``[true, false]`` logits: ``(reference P(True), P(True))``
    #: label-free, else ``(two-way logits, correctness)``; None: none
    p_true_fit: Callable | None = None
    #: its token-level counterpart (a cloze fit then also fits the answer positions'
    #: next-token temperature, :mod:`calm_training.posthoc.token_fit`): ``(model logits,
    #: reference logits, n_questions=)`` label-free, else ``(logits, answer token ids)``;
    #: None: none
    token_fit: Callable | None = None
    #: compared in the multiple-choice modes (cloze, letter) / in P(True) mode
    choice: bool = True
    p_true: bool = False
    #: ``calm fit`` writes it as an adapter
    writes_adapter: bool = True
    #: why ``calm fit`` writes no adapter for it (the start of the error line)
    refusal: str | None = None

    #: vector scaling (a weight and a bias per option), else one temperature
    vector = False
    #: picks an abstention threshold on a base adapter rather than fitting a calibration
    abstention = False

    @property
    def baseline(self) -> bool:
        """The uncalibrated baseline: nothing to fit."""
        return self.option_fit is None and self.p_true_fit is None and not self.abstention

    @property
    def token_level(self) -> bool:
        """Whether it has a token-level counterpart (:attr:`token_fit`)."""
        return self.token_fit is not None

    @property
    def kind(self) -> str:
        """The adapter kind it writes (after the base adapter's: ``calm+daca``)."""
        return self.name.replace("-", "_")

    def fits_in(self, scoring) -> bool:
        """Whether it is compared in the scoring mode ``scoring`` (a
        :class:`calm_runtime.modes.Mode`)."""
        return self.choice if scoring.choice else self.p_true

    def not_fitted_because(self, plan: FitPlan) -> str | None:
        """Why ``calm eval --compare`` does not fit it on ``plan``, else ``None``."""
        return None

    # ------------------------------------------------------------------ fitting arrays
    def fit_options(self, scores, *, reference=None, labels=None):
        """The fit on option scores ``scores`` ``[N, K]`` (None for the baseline)."""
        if self.option_fit is None:
            return None
        if self.needs_reference:
            return self.option_fit(reference, scores)
        return self.option_fit(scores, labels)

    def fit_tokens(self, logits, *, targets=None, reference=None, n_questions=None):
        """The token-level fit on the answer positions' next-token logits ``logits``
        ``[P, V]``: against the reference's logits at the same positions (label-free;
        ``n_questions`` the questions they belong to), else against the answer tokens
        ``targets`` ``[P]``."""
        if self.needs_reference:
            return self.token_fit(logits, reference, n_questions=n_questions)
        return self.token_fit(logits, targets)

    def fit_p_true(self, two_way, *, reference=None, correct=None):
        """The fit on two-way logits ``two_way`` ``[N, 2]`` (None for the baseline):
        label-free methods fit the model's P(True) to the reference's."""
        if self.p_true_fit is None:
            return None
        if self.needs_reference:
            return self.p_true_fit(p_true_probability(reference), p_true_probability(two_way))
        return self.p_true_fit(two_way, correct)

    def fit_judgements(self, judged: dict, cal):
        """The fit on the calibration rows ``cal`` of P(True) judgements ``judged``
        (:meth:`FitPlan.judgements <calm_training.posthoc.plan.FitPlan.judgements>`)."""
        if self.needs_reference and "plm" not in judged:
            raise ConfigError("label-free P(True) calibration needs --reference")
        return self.fit_p_true(judged["polm"][cal],
                               reference=judged["plm"][cal] if self.needs_reference else None,
                               correct=judged["correct"][cal])

    def p_true_probabilities(self, fit, two_way):
        """P(True) of two-way logits ``two_way`` under ``fit`` (None: uncalibrated)."""
        return p_true_probability(two_way, 1.0 if fit is None else fit.temperature)

    def fit_prepared(self, prep: Prepared):
        """The fit on the calibration split of ``prep``'s option scores, reading the
        reference's scores or the answers as the method needs."""
        labels = prep.labeled(prep.cal, "calibration") if self.needs_labels else None
        reference = prep.plm[prep.cal] if self.needs_reference else None
        return self.fit_options(prep.polm[prep.cal], reference=reference, labels=labels)

    # ------------------------------------------------------------------ calm fit
    def check_writable(self, plan: FitPlan) -> None:
        """A one-line :class:`ConfigError`, before any scoring, when ``calm fit`` cannot
        write this method's adapter for ``plan``."""
        if not self.writes_adapter:
            raise ConfigError(f"{self.refusal}; choose daca, naive or ts")
        if not plan.mode.choice and plan.config.adapter:
            raise ConfigError("P(True) fits on top of another adapter are not supported yet; "
                              "fit without --adapter")

    def fit(self, plan: FitPlan, *, progress: bool = True, head_temperature: bool = True
            ) -> Fitted:
        """Fit on the plan's calibration split: the option scores (cloze and letter) or
        P(True)'s two-way logits.

        Cloze mode with the token-level fit: ``head_temperature`` puts the token-level
        temperature into the head and fits the answer temperature on the scores it gives
        (a head temperature can change which option wins); ``False`` fits the answer
        temperature on the model's own scores (the answers stay the model's) and records the
        token-level temperature without writing it."""
        if not plan.mode.choice:  # P(True): the answers' judgements, computed once
            judged = plan.judgements(progress=progress)
            cal, _ = plan.split
            fit = self.fit_judgements(judged, cal)
            check_finite_temperature(fit)
            return Fitted(fit=fit, report={"fit": fit.to_dict(), "calibration_split": {}},
                          n_calibration=int(cal.size))
        prep = prepare(plan, need_reference=self.needs_reference, progress=progress)
        before = prep.polm
        check_score_spread(plan, prep)
        fit = self.fit_prepared(prep)
        check_usable_temperature(fit, plan, prep)
        token_temperature = record = None
        if not plan.mode.token_level and plan.score_logs:  # no token distributions there
            record = {"fitted": False, "reason": "the scores come from lm-eval logs, which "
                      "hold each option's log-likelihood, not the next-token distributions "
                      "a token-level fit needs; only the answer temperature is fitted"}
        elif not plan.mode.token_level and not plan.config.token_fit:
            record = {"fitted": False, "reason": "--no-token-fit: the answer temperature "
                      "only (token confidences stay the model's own)"}
        elif not plan.mode.token_level:  # cloze: the token level first, then the options
            token_temperature, record = cloze_token_fit(self, plan, prep, progress=progress)
            if token_temperature is not None and not head_temperature:
                record = {**record, "in_head": False}
                token_temperature = None
            elif token_temperature is not None:
                base, _ = plan.base
                prep = rescored(plan, prep, base.temperature * token_temperature,
                                progress=progress)
                fit = self.fit_prepared(prep)
                check_usable_temperature(fit, plan, prep)
        cal_metrics = {}
        labels = prep.calibration_labels()
        if labels is not None:
            n_bins = plan.config.n_bins
            cal_metrics = {
                "before": metrics.calibration_report(apply_fit(None, before[prep.cal]),
                                                     labels, n_bins),
                "after": metrics.calibration_report(apply_fit(fit, prep.polm[prep.cal]),
                                                    labels, n_bins)}
        report = {"fit": fit.to_dict(), "calibration_split": cal_metrics, "token_fit": record}
        return Fitted(fit=fit, report=report, n_calibration=int(prep.cal.size),
                      calibration_split=cal_metrics,
                      token_temperature=token_temperature, token_record=record,
                      served_floor=prep.served_floor, option_ids=prep.option_ids)

    def write(self, plan: FitPlan, fitted: Fitted) -> CalibrationAdapter:
        """The adapter ``fitted`` makes: the base adapter with the fit on it and the record
        of where it came from."""
        base, identity = plan.base
        config = plan.config
        if not plan.mode.choice:
            adapter = dataclasses.replace(base, kind=_kind(base, self.kind) + "_p_true",
                                          created_at=None)
            adapter.temperature = base.temperature * fitted.fit.temperature
            adapter.p_true_template = plan.p_true_template.to_dict()
            adapter.method = {"name": self.name, "mode": "p_true", "fit": fitted.fit.to_dict(),
                              "settings": config.to_dict()}
            adapter.provenance = self.provenance(plan, identity, fitted)
            return adapter
        adapter = dataclasses.replace(base, kind=_kind(base, self.kind), created_at=None)
        self.write_fit(adapter, fitted, plan)
        adapter.method = {"name": self.name, "mode": config.mode,
                          "variant": plan.recorded_variant, "fit": fitted.fit.to_dict(),
                          "settings": config.to_dict()}
        if fitted.token_record is not None:
            adapter.method["token_fit"] = fitted.token_record
        adapter.metrics = {"calibration_split": fitted.calibration_split}
        adapter.provenance = self.provenance(plan, identity, fitted)
        adapter.provenance["base_adapter"] = base.kind if config.adapter else None
        # how the prompts reached the model (chat template or text): the format the
        # calibration holds for
        adapter.provenance["prompt_format"] = plan.prompt_format
        if fitted.served_floor:
            adapter.provenance["served_floor"] = fitted.served_floor
        adapter.validate()
        return adapter

    def write_fit(self, adapter: CalibrationAdapter, fitted: Fitted, plan: FitPlan) -> None:
        """Put the fitted temperature where the mode reads it (see the module's docstring)."""
        base, _ = plan.base
        if plan.mode.token_level:
            adapter.temperature = base.temperature * fitted.fit.temperature
            return
        if fitted.token_temperature is not None:
            adapter.temperature = base.temperature * fitted.token_temperature
        adapter.answer_temperature = fitted.fit.temperature

    def provenance(self, plan: FitPlan, identity, fitted: Fitted) -> dict:
        """What an adapter records of where it came from: the model, the reference
        (label-free methods), the data and the calibration split."""
        config = plan.config
        out = {"model": identity.to_dict(),
               "reference": (plan.reference.identity().to_dict() if self.needs_reference
                             else None),
               "data": config.data, "data_hash": plan.data_hash,
               "split": {"part": "calibration", "fraction": config.calibration_fraction,
                         "seed": config.seed, "n": fitted.n_calibration}}
        placements = {role: source.placement.to_dict()
                      for role, source in (("model", plan.model), ("reference", plan.reference))
                      if source is not None and hasattr(source, "placement")
                      and (role == "model" or self.needs_reference)}
        if placements:  # the dtype and device the scores were computed at
            out["placement"] = placements
        if plan.score_logs:  # the scores' own files, by hash
            out["score_logs"] = {role: log.record() for role, log in plan.score_logs.items()}
        return out


def _kind(base: CalibrationAdapter, name: str) -> str:
    return name if base.kind == "identity" else f"{base.kind}+{name}"


def applies(method) -> bool:
    """Whether ``calm fit METHOD`` takes these flags: methods with a token-level fit."""
    return method.token_level


def add_arguments(parser) -> None:
    """``calm fit``'s flag of the token-level fit (cloze mode)."""
    parser.add_argument("--no-token-fit", dest="token_fit", action="store_false",
                        help="cloze mode: fit the answer temperature only, leaving the engine's "
                             "token confidences the model's own (by default a token-level "
                             "temperature is fitted first and the answer temperature on top; a "
                             "fit from --model-scores logs is always answer-only)")
