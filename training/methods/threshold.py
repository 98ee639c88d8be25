"""``threshold``: an abstention threshold with a stated risk guarantee, chosen on the
calibration split on top of a base adapter (``--adapter``, else the identity); the test
split's coverage and selective risk at that threshold are reported and recorded beside it
(the choice itself: :mod:`calm_training.posthoc.threshold`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from calm_runtime.errors import ConfigError
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_runtime.modes import option_probabilities
from calm_training.methods.fit_method import FitMethod, Fitted
from calm_training.posthoc.option_fit import prepare
from calm_training.posthoc.plan import FitPlan

__all__ = ["THRESHOLD", "ThresholdMethod"]


@dataclass(frozen=True)
class ThresholdMethod(FitMethod):
    """Picks the lowest confidence threshold whose selective risk is bounded (the base
    adapter's calibration unchanged)."""

    abstention = True

    def check_writable(self, plan: FitPlan) -> None:
        if not plan.mode.choice:
            raise ConfigError("calm fit threshold works on multiple-choice answers; use cloze "
                              "or letter mode")
        super().check_writable(plan)

    def fit(self, plan: FitPlan, *, progress: bool = True) -> Fitted:
        from calm_training.posthoc.threshold import fit_threshold

        config = plan.config
        prep = prepare(plan, need_reference=False, progress=progress)
        base, identity = plan.base
        scores = prep.polm
        if identity.served is not None and plan.mode.token_level:  # no engine to fuse T into
            scores = scores / base.temperature
        probs = option_probabilities(scores, plan.mode.answer_temperature(base.answer_temperature))
        conf = probs.max(axis=1)
        labels = prep.labeled(prep.cal, "calibration")
        fit = fit_threshold(conf[prep.cal], (probs[prep.cal].argmax(1) == labels).astype(float),
                            risk=config.risk, confidence=config.risk_confidence)
        test = {}
        if (prep.labels[prep.test] >= 0).all() and prep.test.size:
            kept = conf[prep.test] >= fit.threshold
            right = probs[prep.test].argmax(1) == prep.labels[prep.test]
            test = {"n": int(prep.test.size), "coverage": float(kept.mean()),
                    "selective_risk": (float(1 - right[kept].mean()) if kept.any() else None),
                    "risk_without_abstention": float(1 - right.mean())}
        return Fitted(fit=fit, report={"fit": fit.to_dict(), "test_split": test},
                      test_split=test)

    def write(self, plan: FitPlan, fitted: Fitted) -> CalibrationAdapter:
        config = plan.config
        base, _ = plan.base
        adapter = dataclasses.replace(
            base, created_at=None,
            abstention={**fitted.fit.to_dict(), "mode": config.mode,
                        "variant": plan.recorded_variant, "data": config.data,
                        "test_split": fitted.test_split})
        if not config.adapter:
            adapter.method = {"name": self.name, "mode": config.mode,
                              "variant": plan.recorded_variant, "settings": config.to_dict()}
        return adapter


THRESHOLD = ThresholdMethod("threshold", needs_labels=True, choice=False)
