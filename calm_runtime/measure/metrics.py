"""Calibration metrics (docs/methods.md §5): accuracy, NLL, Brier, ECE, MCE and adaptive ECE;
and how well confidence ranks answers for selective prediction: AUROC, the risk–coverage
curve, AURC, PRR and selective accuracy at thresholds.

numpy only: importing this module never imports torch. Every function validates its
inputs and raises :class:`~calm_runtime.errors.ConfigError` with a one-line message.

Binning. ``"uniform"``: ``n_bins`` equal-width bins; bin ``b`` (1-based) holds
``((b-1)/n, b/n]`` and the first bin also holds 0, so confidences of exactly 0 and 1 are
never dropped. ``"adaptive"``: equal-mass bins; the examples are sorted by confidence
(stable sort, so the order is deterministic) and cut into ``n_bins`` groups with
``np.array_split``, whose sizes differ by at most one (the first ``N % n_bins`` groups get
the extra example). Tied confidences may fall into neighbouring groups. Record the bin
count next to every reported number.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from calm_runtime.errors import ConfigError

__all__ = [
    "ReliabilityBins", "reliability_bins", "accuracy", "nll", "brier", "ece", "mce", "aece",
    "calibration_report", "binary_report", "bootstrap_interval",
    "auroc", "risk_coverage", "aurc", "prr", "selective_accuracy", "selective_report",
    "SELECTIVE_THRESHOLDS",
]

# Probabilities are clipped to [PROB_EPS, 1] before the log, so a zero probability on the
# true label costs -log(1e-12) ~ 27.6 nats instead of making the mean NLL infinite.
PROB_EPS = 1e-12
# Option probabilities from a float16/float32 softmax sum to 1 within ~1e-3; a larger gap
# means logits or unnormalised scores were passed instead of probabilities.
ROW_SUM_ATOL = 1e-3
SCHEMES = ("uniform", "adaptive")


@dataclasses.dataclass(frozen=True, eq=False)
class ReliabilityBins:
    """Per-bin statistics behind a reliability diagram; each array has one entry per bin.

    Attributes:
        scheme: ``"uniform"`` (equal-width) or ``"adaptive"`` (equal-mass).
        lower: lower bin edge. Uniform: ``(b-1)/n``. Adaptive: the smallest confidence in
            the bin (NaN when the bin is empty).
        upper: upper bin edge. Uniform: ``b/n``. Adaptive: the largest confidence in the
            bin (NaN when empty).
        count: number of examples in the bin.
        confidence: mean confidence in the bin (NaN when empty).
        accuracy: fraction of correct examples in the bin (NaN when empty).
    """

    scheme: str
    lower: np.ndarray
    upper: np.ndarray
    count: np.ndarray
    confidence: np.ndarray
    accuracy: np.ndarray

    @property
    def n_bins(self) -> int:
        """Number of bins, empty ones included."""
        return int(self.count.size)

    @property
    def n(self) -> int:
        """Number of examples over all bins."""
        return int(self.count.sum())

    @property
    def gap(self) -> np.ndarray:
        """``|accuracy - confidence|`` per bin (NaN for empty bins)."""
        return np.abs(self.accuracy - self.confidence)

    @property
    def ece(self) -> float:
        """``sum_b (n_b / N) |acc_b - conf_b|`` over the non-empty bins."""
        filled = self.count > 0
        return float(np.sum(self.count[filled] / self.n * self.gap[filled]))

    @property
    def mce(self) -> float:
        """The largest ``|acc_b - conf_b|`` over the non-empty bins."""
        return float(np.max(self.gap[self.count > 0]))


def accuracy(probs: Any, labels: Any) -> float:
    """Fraction of examples whose most probable option (``argmax``) is the label.

    ``probs`` is ``[N, K]`` option probabilities (rows sum to 1), ``labels`` ``[N]``
    integers in ``[0, K)``. Ties go to the lowest option index, as ``np.argmax`` does.
    """
    p, y = _check_probs(probs, labels, ndim=2, caller="accuracy")
    return float(np.mean(np.argmax(p, axis=1) == y))


def nll(probs: Any, labels: Any) -> float:
    """Mean negative log-likelihood (nats) of the labels, probabilities clipped at ``PROB_EPS``.

    ``probs`` is ``[N, K]`` option probabilities with integer labels, or ``[N]`` binary
    probabilities ``P(label = 1)`` (e.g. P(True)) with 0/1 labels.
    """
    p, y = _check_probs(probs, labels)
    if p.ndim == 1:
        p_label = np.where(y == 1, p, 1.0 - p)
    else:
        p_label = p[np.arange(p.shape[0]), y]
    return float(-np.mean(np.log(np.clip(p_label, PROB_EPS, 1.0))))


def brier(probs: Any, labels: Any) -> float:
    """Brier score.

    Multi-class form for ``[N, K]`` probabilities: mean over examples of
    ``sum_k (p_k - 1[k = y])^2`` (range [0, 2]). Binary form for ``[N]`` probabilities
    ``P(label = 1)`` with 0/1 labels: ``mean((p - y)^2)`` (range [0, 1]).
    """
    p, y = _check_probs(probs, labels)
    if p.ndim == 1:
        return float(np.mean((p - y) ** 2))
    # sum_k (p_k - 1[k=y])^2 = sum_k p_k^2 - 2 p_y + 1, without a [N, K] one-hot matrix.
    p_label = p[np.arange(p.shape[0]), y]
    return float(np.mean(np.sum(p * p, axis=1) - 2.0 * p_label + 1.0))


def reliability_bins(confidences: Any, correct: Any, n_bins: int = 10,
                     scheme: str = "uniform") -> ReliabilityBins:
    """Bin ``confidences`` (``[N]`` in [0, 1]) with their ``correct`` flags (``[N]``, 0/1).

    ``scheme`` is ``"uniform"`` or ``"adaptive"`` (see the module docstring for the exact
    bin rules). Returns a :class:`ReliabilityBins` with read-only arrays.
    """
    conf, corr = _check_confidences(confidences, correct)
    n_bins = _check_positive_int(n_bins, "n_bins", 10)
    if scheme == "uniform":
        edges = np.arange(n_bins + 1) / n_bins  # b / n correctly rounded, so 0.3 == edge 3/10
        ids = np.clip(np.searchsorted(edges, conf, side="left") - 1, 0, n_bins - 1)
        lower, upper = edges[:-1], edges[1:]
    elif scheme == "adaptive":
        order = np.argsort(conf, kind="stable")
        conf, corr = conf[order], corr[order]
        sizes = np.array([part.size for part in np.array_split(order, n_bins)])
        ids = np.repeat(np.arange(n_bins), sizes)
        filled = sizes > 0
        starts = np.cumsum(sizes) - sizes
        lower, upper = np.full(n_bins, np.nan), np.full(n_bins, np.nan)
        lower[filled] = conf[starts[filled]]
        upper[filled] = conf[starts[filled] + sizes[filled] - 1]
    else:
        raise ConfigError(f"scheme must be one of {SCHEMES}, got {scheme!r}; "
                          "use 'uniform' (equal width) or 'adaptive' (equal mass)")
    count = np.bincount(ids, minlength=n_bins)
    stats = (lower, upper, count, _bin_mean(ids, conf, count), _bin_mean(ids, corr, count))
    for array in stats:
        array.setflags(write=False)
    return ReliabilityBins(scheme, *stats)


def ece(confidences: Any, correct: Any, n_bins: int = 10) -> float:
    """Expected calibration error with ``n_bins`` equal-width bins."""
    return reliability_bins(confidences, correct, n_bins, "uniform").ece


def mce(confidences: Any, correct: Any, n_bins: int = 10) -> float:
    """Maximum calibration error: the largest bin gap over non-empty equal-width bins."""
    return reliability_bins(confidences, correct, n_bins, "uniform").mce


def aece(confidences: Any, correct: Any, n_bins: int = 10) -> float:
    """Adaptive ECE: the ECE formula over ``n_bins`` equal-mass bins."""
    return reliability_bins(confidences, correct, n_bins, "adaptive").ece


def calibration_report(probs: Any, labels: Any, n_bins: int = 10) -> dict[str, float | int]:
    """All metrics for ``[N, K]`` option probabilities and integer labels.

    Confidence is the largest option probability and an example is correct when its argmax
    is the label. Returns ``accuracy, ece, mce, aece, brier, nll`` (floats) and ``n``,
    ``n_bins`` (ints).
    """
    p, y = _check_probs(probs, labels, ndim=2, caller="calibration_report")
    correct = np.argmax(p, axis=1) == y
    return _report(p, y, np.max(p, axis=1), correct, float(np.mean(correct)), n_bins)


def binary_report(p_true: Any, labels: Any, n_bins: int = 10) -> dict[str, float | int]:
    """All metrics for P(True)-style scores: ``p_true[i]`` is the confidence that answer ``i``
    is correct and ``labels[i]`` (0/1) says whether it is.

    ECE/MCE/AECE use ``p_true`` as the confidence and ``labels`` as correctness; Brier and
    NLL use their binary forms. ``accuracy`` is the fraction of correct answers (what the
    mean of ``p_true`` should match). Same keys as :func:`calibration_report`.
    """
    p, y = _check_probs(p_true, labels, ndim=1, caller="binary_report")
    return _report(p, y, p, y, float(np.mean(y)), n_bins)


def _report(p: np.ndarray, y: np.ndarray, confidences: np.ndarray, correct: np.ndarray,
            accuracy_value: float, n_bins: int) -> dict[str, float | int]:
    uniform = reliability_bins(confidences, correct, n_bins, "uniform")
    return {"accuracy": accuracy_value, "ece": uniform.ece, "mce": uniform.mce,
            "aece": aece(confidences, correct, n_bins), "brier": brier(p, y), "nll": nll(p, y),
            "n": int(y.size), "n_bins": int(n_bins)}


# ---- selective prediction -----------------------------------------------------------------
#
# Ties. Answers with equal confidence are kept or rejected together by any threshold, so the
# curves below move in whole tie groups: AUROC counts a tied (correct, wrong) pair as 1/2
# (as scikit-learn's roc_auc_score does), and within a tie group the risk–coverage curve
# accumulates errors at the group's error rate (the expectation over the orders the group
# could be sorted in), so no metric depends on how a sort happens to break ties.

#: The thresholds of :func:`selective_accuracy` by default: 0.5, 0.55, ..., 0.95.
SELECTIVE_THRESHOLDS = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))


def auroc(confidences: Any, correct: Any) -> float:
    """Area under the ROC curve of confidence as a detector of correct answers: the
    probability that a random correct answer has higher confidence than a random wrong one
    (ties count 1/2). 0.5 for a constant confidence, 1.0 for a perfect ranking; NaN when
    every answer is correct or every answer is wrong (no pair to rank)."""
    conf, ok = _check_confidences(confidences, correct)
    n_pos = float(ok.sum())
    n_neg = float(ok.size - n_pos)
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = _average_ranks(conf)
    return float((ranks[ok == 1].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def risk_coverage(confidences: Any, correct: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(coverage, risk)`` at every ``k = 1..N`` answers kept, most confident first:
    ``coverage = k / N`` and ``risk`` = the share of wrong answers among the ``k`` kept
    (expected over tie orders, see above)."""
    conf, ok = _check_confidences(confidences, correct)
    errors = _expected_cumulative_errors(conf, 1.0 - ok)
    k = np.arange(1, conf.size + 1, dtype=np.float64)
    return k / conf.size, errors / k


def aurc(confidences: Any, correct: Any) -> float:
    """Area under the risk–coverage curve, ``mean_k risk(k)``: lower is better; the error
    rate for an uninformative confidence."""
    return float(np.mean(risk_coverage(confidences, correct)[1]))


def prr(confidences: Any, correct: Any) -> float:
    """Prediction rejection ratio: ``(AURC_random - AURC) / (AURC_random - AURC_oracle)``,
    where random keeps answers in random order (AURC = error rate) and the oracle keeps the
    correct ones first. 1 for a perfect ranking, 0 for an uninformative one, negative when
    confidence prefers wrong answers; NaN when there is nothing to rank (no errors or no
    correct answers)."""
    conf, ok = _check_confidences(confidences, correct)
    random_area = 1.0 - float(ok.mean())
    oracle_area = aurc(ok, ok)  # confidence = correctness: every correct answer first
    if random_area - oracle_area <= 0:
        return float("nan")
    return float((random_area - aurc(conf, ok)) / (random_area - oracle_area))


def selective_accuracy(confidences: Any, correct: Any,
                       thresholds: Any = SELECTIVE_THRESHOLDS) -> list[dict[str, float]]:
    """For each threshold ``t``: the answers with confidence ``>= t`` are kept; returns
    ``{"threshold", "coverage", "accuracy", "n"}`` (accuracy NaN when none is kept)."""
    conf, ok = _check_confidences(confidences, correct)
    rows = []
    for t in np.asarray(thresholds, dtype=np.float64).ravel():
        kept = conf >= t
        n = int(kept.sum())
        rows.append({"threshold": float(t), "coverage": n / conf.size,
                     "accuracy": float(ok[kept].mean()) if n else float("nan"), "n": n})
    return rows


def selective_report(confidences: Any, correct: Any, *, bootstrap: int = 0,
                     seed: int = 0) -> dict[str, Any]:
    """AUROC, AURC, PRR and selective accuracy; with ``bootstrap`` resamples, 95% intervals
    of the first three (as ``*_ci``), resampled like the ECE's."""
    conf, ok = _check_confidences(confidences, correct)
    out: dict[str, Any] = {"auroc": auroc(conf, ok), "aurc": aurc(conf, ok),
                           "prr": prr(conf, ok), "selective": selective_accuracy(conf, ok)}
    if bootstrap:
        for name, fn in (("auroc", auroc), ("aurc", aurc), ("prr", prr)):
            out[f"{name}_ci"] = list(bootstrap_interval(fn, conf, ok, n_resamples=bootstrap,
                                                        seed=seed))
    return out


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties given the mean of the ranks they span."""
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_values)) + 1]
    ends = np.r_[starts[1:], values.size]
    ranks = np.empty(values.size)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def _expected_cumulative_errors(conf: np.ndarray, wrong: np.ndarray) -> np.ndarray:
    """Cumulative error counts with the most confident first; inside a tie group the errors
    are spread evenly (their expectation over the group's orders)."""
    order = np.argsort(-conf, kind="stable")
    c, w = conf[order], wrong[order]
    starts = np.r_[0, np.flatnonzero(np.diff(c)) + 1]
    ends = np.r_[starts[1:], c.size]
    group_errors = np.add.reduceat(w, starts)
    rate = np.repeat(group_errors / (ends - starts), ends - starts)
    return np.cumsum(rate)


def bootstrap_interval(metric_fn: Callable[..., float], *arrays: Any, n_resamples: int = 1000,
                       confidence: float = 0.95, seed: int = 0,
                       bias_corrected: bool = False) -> tuple[float, float]:
    """Percentile bootstrap interval of ``metric_fn(*arrays)``.

    ``bias_corrected``: shift the interval by the bootstrap's estimate of the metric's bias
    (the mean of the resampled metric minus the metric on the data). Binned ECE is biased
    upward, more so on a resample (a duplicated question sharpens its bin), so the plain
    percentile interval of a small ECE can lie wholly above the estimate; shifted, it is
    centred where the estimate is.

    Each resample draws ``N`` row indices with replacement and applies the same indices to
    every array (paired resampling), so ``bootstrap_interval(ece, conf, correct)`` keeps
    each confidence with its label. Deterministic for a given ``seed``. Returns the
    ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` percentiles of the resampled metric
    over the resamples where it is defined (AUROC, PRR: NaN without both kinds of answer).
    Pass extra metric arguments with ``functools.partial`` or a lambda.
    """
    if not callable(metric_fn) or not arrays:
        raise ConfigError(f"bootstrap_interval needs a callable metric and at least one data "
                          f"array, got {type(metric_fn).__name__} and {len(arrays)} arrays; "
                          "call it as bootstrap_interval(ece, confidences, correct)")
    data = [np.asarray(a) for a in arrays]
    lengths = [a.shape[0] if a.ndim else -1 for a in data]
    if len(set(lengths)) != 1 or lengths[0] <= 0:
        raise ConfigError(f"bootstrap arrays must be non-empty with the same first dimension, "
                          f"got lengths {lengths}; pass one entry per example in each array")
    _check_positive_int(n_resamples, "n_resamples", 1000)
    if not 0.0 < confidence < 1.0:
        raise ConfigError(f"confidence must lie strictly between 0 and 1, got {confidence!r}; "
                          "use e.g. 0.95")
    rng = np.random.default_rng(seed)
    n = lengths[0]
    stats = np.empty(n_resamples)
    for r in range(n_resamples):
        idx = rng.integers(0, n, size=n)
        stats[r] = float(metric_fn(*(a[idx] for a in data)))
    tail = 100.0 * (1.0 - confidence) / 2.0
    defined = stats[np.isfinite(stats)]  # resamples where the metric is undefined drop out
    if defined.size == 0:
        return float("nan"), float("nan")
    low, high = np.percentile(defined, [tail, 100.0 - tail])
    if bias_corrected:
        bias = float(defined.mean()) - float(metric_fn(*data))
        low, high = low - bias, high - bias
    return float(low), float(high)


# ---- validation helpers -------------------------------------------------------------------

def _as_float(values: Any, name: str) -> np.ndarray:
    try:
        return np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name} must be numeric, could not convert it ({exc}); "
                          "pass a numpy array of numbers") from exc


def _check_unit_interval(values: np.ndarray, name: str) -> None:
    if values.size == 0:
        raise ConfigError(f"{name} is empty (shape {values.shape}); pass at least one example")
    bad = ~((values >= 0.0) & (values <= 1.0))  # also catches NaN
    if bad.any():
        first = np.unravel_index(np.argmax(bad), values.shape)
        raise ConfigError(f"{name} must lie in [0, 1] (no NaN); {int(bad.sum())} values do not "
                          f"(first at index {tuple(map(int, first))}: {float(values[first])}); "
                          "pass probabilities, not logits, scores or NaN")


def _check_binary(values: Any, name: str, n: int) -> np.ndarray:
    flags = _as_float(values, name)
    if flags.shape != (n,):
        raise ConfigError(f"{name} must have shape ({n},) to match the probabilities, got "
                          f"{flags.shape}; pass one 0/1 flag per example")
    bad = (flags != 0.0) & (flags != 1.0)
    if bad.any():
        first = int(np.argmax(bad))
        raise ConfigError(f"{name} must be 0/1 (or bool); {int(bad.sum())} values are not "
                          f"(first at index {first}: {flags[first]!r}); pass correctness flags")
    return flags


def _check_confidences(confidences: Any, correct: Any) -> tuple[np.ndarray, np.ndarray]:
    conf = _as_float(confidences, "confidences")
    if conf.ndim != 1:
        raise ConfigError(f"confidences must be 1-D [N], got shape {conf.shape}; "
                          "take the max over options first (or use calibration_report)")
    _check_unit_interval(conf, "confidences")
    return conf, _check_binary(correct, "correct", conf.size)


def _check_probs(probs: Any, labels: Any, ndim: int | None = None,
                 caller: str = "probs") -> tuple[np.ndarray, np.ndarray]:
    """Validate ``[N, K]`` probabilities with integer labels, or ``[N]`` with 0/1 labels."""
    p = _as_float(probs, "probs")
    if p.ndim not in ((1, 2) if ndim is None else (ndim,)):
        raise ConfigError(f"{caller} got probabilities of shape {p.shape}; pass [N, K] option "
                          "probabilities (calibration_report) or [N] P(True) (binary_report)")
    _check_unit_interval(p, "probs")
    if p.ndim == 1:
        return p, _check_binary(labels, "labels", p.size)
    row_error = np.abs(p.sum(axis=1) - 1.0)
    if np.any(row_error > ROW_SUM_ATOL):
        row = int(np.argmax(row_error))
        raise ConfigError(f"probs rows must sum to 1 (tolerance {ROW_SUM_ATOL}); row {row} "
                          f"sums to {p[row].sum():.6g}; apply softmax over the options first")
    y = np.asarray(labels)
    if y.shape != (p.shape[0],):
        raise ConfigError(f"labels must have shape ({p.shape[0]},) to match probs "
                          f"{p.shape}, got {y.shape}; pass one label per example")
    if not np.issubdtype(y.dtype, np.integer):
        raise ConfigError(f"labels must be integer option indices, got dtype {y.dtype}; "
                          "convert with labels.astype(int)")
    bad = (y < 0) | (y >= p.shape[1])
    if bad.any():
        first = int(np.argmax(bad))
        raise ConfigError(f"labels must lie in [0, {p.shape[1]}) for {p.shape[1]} options; "
                          f"{int(bad.sum())} do not (first at index {first}: {int(y[first])}); "
                          "check the label mapping")
    return p, y


def _check_positive_int(value: Any, name: str, example: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}; use e.g. {example}")
    return int(value)


def _bin_mean(ids: np.ndarray, values: np.ndarray, count: np.ndarray) -> np.ndarray:
    sums = np.bincount(ids, weights=values, minlength=count.size)
    return np.divide(sums, count, out=np.full(count.size, np.nan), where=count > 0)
