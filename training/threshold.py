"""Choosing a confidence threshold for abstention with a stated risk guarantee.

Below the threshold the runtime still returns the probabilities but marks the answer
``abstained``. The threshold is the lowest one (the most answers kept) whose selective risk
— the share of wrong answers among those kept — is at most ``risk`` with probability
``confidence``, judged on the labeled calibration split:

* For a candidate threshold ``t`` keeping ``n`` answers with ``e`` errors, the risk's upper
  bound is the one-sided Clopper–Pearson bound: the ``p`` with ``P(Binomial(n, p) <= e) =
  1 - confidence``.
* Candidates are the distinct confidences, tested from the highest down (fixed-sequence
  testing); the scan stops at the first candidate whose bound exceeds ``risk``. Testing in a
  fixed order and stopping at the first failure keeps the overall error probability at
  ``1 - confidence`` without a multiple-testing correction, so the guarantee holds for the
  threshold chosen, not only for each candidate alone (on new questions drawn like the
  calibration split). The scan starts at the first candidate that keeps at least
  ``n_min = ceil(log(1 - confidence) / log(1 - risk))`` answers — the fewest with which even
  zero errors can pass — a starting point fixed by ``risk`` and ``confidence`` alone, so the
  order of the tests does not depend on the labels.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from calm_runtime.errors import ConfigError, FitError

__all__ = ["ThresholdFit", "binomial_upper_bound", "fit_threshold"]


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
    order = np.argsort(-conf, kind="stable")
    conf, ok = conf[order], ok[order]
    best = None
    n_min = math.ceil(math.log(1.0 - confidence) / math.log(1.0 - risk))
    for t in np.unique(conf)[::-1]:  # highest first
        kept = conf >= t
        n_kept = int(kept.sum())
        if n_kept < n_min:
            continue
        errors = int(n_kept - ok[kept].sum())
        bound = binomial_upper_bound(errors, n_kept, confidence)
        if bound > risk:
            break
        best = ThresholdFit(threshold=float(t), risk=risk, confidence=confidence,
                            coverage=n_kept / conf.size, selective_risk=errors / n_kept,
                            risk_upper_bound=bound, n=int(conf.size), n_kept=n_kept)
    if best is None:
        kept = conf >= conf[min(n_min, conf.size) - 1]
        n_top = int(kept.sum())
        bound = binomial_upper_bound(int(n_top - ok[kept].sum()), n_top, confidence)
        raise FitError(f"no threshold keeps the selective risk at or below {risk:g} with "
                       f"probability {confidence:g} on these {conf.size} answers (even the "
                       f"{n_top} most confident have a risk bound of {bound:.3f}); allow a "
                       "higher --risk or use more calibration data")
    return best
