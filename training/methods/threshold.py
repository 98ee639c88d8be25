"""``threshold``: a confidence threshold for abstention with a stated risk guarantee, chosen on
the calibration split on top of a base adapter (``--adapter``, else the identity); the test
split's coverage and selective risk at that threshold are reported and recorded beside it.

Below the threshold the runtime still returns the probabilities but marks the answer
``abstained``. The threshold is the lowest one (the most answers kept) whose selective risk
— the share of wrong answers among those kept — is at most ``risk`` with probability
``confidence``, judged on the labeled calibration split:

* For a candidate threshold ``t`` keeping ``n`` answers with ``e`` errors, the risk's upper
  bound is the one-sided Clopper–Pearson bound: the ``p`` with ``P(Binomial(n, p) <= e) =
  delta``.
* The candidates are a grid fixed in advance, :data:`GRID` (0.05, 0.10, ..., 0.95), and each
  is tested at ``delta = (1 - confidence) / len(GRID)`` (Bonferroni), so the chance that any
  accepted candidate's true risk exceeds ``risk`` is at most ``1 - confidence``: the
  guarantee holds for the threshold chosen (the lowest accepted), on new questions drawn like
  the calibration split. (Scanning down from the most confident answers and stopping at the
  first failure needs no correction, but one badly ranked answer at the top stops it; the
  fixed grid does not depend on how the top few are ranked.)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass

import numpy as np

from calm_runtime.errors import ConfigError, FitError
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_runtime.modes import option_probabilities
from calm_training.methods.fit_method import FitMethod, Fitted
from calm_training.posthoc.fit_config import FitConfig
from calm_training.posthoc.option_fit import prepare
from calm_training.posthoc.plan import FitPlan

__all__ = ["GRID", "SETTINGS", "THRESHOLD", "ThresholdFit", "ThresholdMethod",
           "add_arguments", "binomial_upper_bound", "fit_threshold"]

#: the :class:`~calm_training.posthoc.fit_config.FitConfig` settings ``calm fit threshold``
#: reads (the selective risk and the probability of staying at or below it), set by the
#: flags :func:`add_arguments` declares
SETTINGS = ("risk", "risk_confidence")

#: The candidate thresholds, fixed before the data is seen.
GRID = tuple(round(0.05 * i, 2) for i in range(1, 20))


@dataclass(frozen=True)
class ThresholdFit:
    threshold: float
    risk: float
    confidence: float
    coverage: float
    selective_risk: float
    risk_upper_bound: float
    n: int
    n_kept: int
    method: str = "threshold"

    def to_dict(self) -> dict:
        return asdict(self)


def _log_binom_cdf(errors: int, n: int, p: float) -> float:
    """``log P(Binomial(n, p) <= errors)``, summed in log space (exact for any ``n``)."""
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 0.0 if errors >= n else -math.inf
    terms = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
             + k * math.log(p) + (n - k) * math.log1p(-p) for k in range(errors + 1)]
    top = max(terms)
    return top + math.log(sum(math.exp(t - top) for t in terms))


def binomial_upper_bound(errors: int, n: int, confidence: float) -> float:
    """One-sided Clopper–Pearson upper bound on a rate from ``errors`` of ``n``."""
    if n <= 0:
        return 1.0
    if errors >= n:
        return 1.0
    target = math.log(1.0 - confidence)
    low, high = errors / n, 1.0
    for _ in range(100):  # P(X <= e) falls as p rises: bisect for P = 1 - confidence
        mid = (low + high) / 2
        if _log_binom_cdf(errors, n, mid) > target:
            low = mid
        else:
            high = mid
    return high


def fit_threshold(confidences, correct, *, risk: float, confidence: float = 0.95
                  ) -> ThresholdFit:
    """The lowest threshold whose selective risk is at most ``risk`` with probability
    ``confidence`` (see the module docstring); a :class:`FitError` when none is."""
    if not 0.0 < risk < 1.0:
        raise ConfigError(f"risk must lie strictly between 0 and 1, got {risk!r}; e.g. 0.1")
    if not 0.5 <= confidence < 1.0:
        raise ConfigError(f"confidence must lie in [0.5, 1), got {confidence!r}; e.g. 0.95")
    conf = np.asarray(confidences, dtype=np.float64)
    ok = np.asarray(correct, dtype=np.float64)
    if conf.ndim != 1 or conf.shape != ok.shape or conf.size == 0:
        raise ConfigError("confidences and correct must be equal-length non-empty vectors")
    best = None
    delta = (1.0 - confidence) / len(GRID)
    for t in GRID[::-1]:  # every candidate is tested; the lowest accepted one is kept
        kept = conf >= t
        n_kept = int(kept.sum())
        if not n_kept:
            continue
        errors = int(n_kept - ok[kept].sum())
        bound = binomial_upper_bound(errors, n_kept, 1.0 - delta)
        if bound <= risk:
            best = ThresholdFit(threshold=float(t), risk=risk, confidence=confidence,
                                coverage=n_kept / conf.size, selective_risk=errors / n_kept,
                                risk_upper_bound=bound, n=int(conf.size), n_kept=n_kept)
    if best is None:
        bounds = []
        for t in GRID:
            kept = conf >= t
            if kept.any():
                n_kept = int(kept.sum())
                bounds.append(binomial_upper_bound(int(n_kept - ok[kept].sum()), n_kept,
                                                   1.0 - delta))
        lowest = min(bounds, default=1.0)
        reachable = math.ceil(lowest * 20) / 20  # the next risk in steps of 0.05
        allow = (f"allow --risk {reachable:g} or higher, or " if reachable < 1 else "")
        raise FitError(f"no threshold of the grid keeps the selective risk at or below "
                       f"{risk:g} with probability {confidence:g} on these {conf.size} "
                       f"calibration answers (the lowest bound they carry is {lowest:.3f}); "
                       f"{allow}use more labelled calibration data (fewer answers, or a less "
                       "accurate model, carry only looser bounds)")
    return best


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


def applies(method) -> bool:
    """Whether ``calm fit METHOD`` takes these flags: the abstention threshold's."""
    return method.abstention


def add_arguments(parser) -> None:
    """``calm fit``'s flags of the abstention threshold (defaults: FitConfig's)."""
    parser.add_argument("--risk", type=float, default=FitConfig.risk,
                        help="threshold: the selective risk (share of wrong answers kept) to "
                             f"stay at or below (default {FitConfig.risk})")
    parser.add_argument("--risk-confidence", type=float, default=FitConfig.risk_confidence,
                        help="threshold: the probability of staying below --risk, by a "
                             "Clopper-Pearson bound on the calibration split (default "
                             f"{FitConfig.risk_confidence})")
