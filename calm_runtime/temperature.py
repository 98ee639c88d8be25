"""The label-free and labeled temperature fits' one solver (docs/methods.md §3), numpy only.

With ``beta = 1 / T`` the cross-entropy ``-beta p.g + logsumexp(beta g)`` of option (or token)
logits ``g`` against target rows ``p`` is convex in ``beta``, and its derivative
``E_softmax(beta g)[g] - p.g`` is monotone: :func:`solve_inverse_temperature` finds the
optimum by one safeguarded Newton/bisection root search (deterministic, tight tolerance, no
learning rate). Temperature scaling with labels (:func:`fit_temperature_scaling`) is the same
search with one-hot targets; DACA's fits (``calm_training.methods.daca``) hand it the
reference's probabilities on the agreeing items. It lives in the runtime package because an
exported engine refits its temperature here too (``calm-export --recalibrate``), and export
does not import training. Applying a fit is ``calm_runtime.calibration.apply_calibration``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import numpy as np

from calm_runtime.errors import ConfigError, FitError

__all__ = ["TemperatureFit", "as_labels", "as_matrix", "fit_temperature_scaling",
           "mean_entropy", "scalar_fit", "solve_inverse_temperature",
           "solve_inverse_temperature_scores", "temperature_fit"]

logger = logging.getLogger(__name__)

# Root search, in units where the PoLM logits' mean per-row range is 1 (scale-free).
DERIVATIVE_TOL = 1e-10  # |dL/dbeta| below this is a root (float64 rounding is ~1e-16).
BRACKET_RTOL = 1e-12  # or the bracket [lo, hi] is narrower than this relative to hi.
BETA_CAP = 1e6  # beta * range above this: T is a millionth of the logit range, i.e. T -> 0.
MAX_EVALUATIONS = 200  # bisection alone reaches BRACKET_RTOL in ~40 halvings after ~20 doublings.



@dataclass(frozen=True)
class TemperatureFit:
    """A fitted scalar temperature (apply as ``apply_calibration(z, temperature=T)``).

    ``method`` is "daca", "naive" (no agreement mask), "ts" (labeled), "daca_p_true" or
    "naive_p_true". ``n`` items were given, ``n_used`` entered the objective;
    ``agreement_rate`` is the fraction where the two models' argmax agree (``None`` for
    labeled fits). ``objective`` is the mean KL(p || calibrated) for DACA, the mean NLL for
    labeled fits, at the optimum. ``at_bound`` is ``None`` for an interior optimum,
    "infinite_temperature" (``beta = 0``, ``temperature = inf``: uniform is best) or
    "zero_temperature" (``beta`` hit the cap; ``temperature`` is the tiny capped value).
    ``iterations`` counts objective-derivative evaluations of the root search.
    """

    method: str
    temperature: float
    beta: float
    n: int
    n_used: int
    agreement_rate: float | None
    objective: float
    at_bound: str | None
    iterations: int

    def to_dict(self) -> dict:
        """A JSON-safe dict; an infinite temperature is written as ``None`` (see ``at_bound``)."""
        out = dataclasses.asdict(self)
        if not math.isfinite(self.temperature):
            out["temperature"] = None
        return out



def solve_inverse_temperature(logits, targets) -> tuple[float, dict]:
    """Minimise ``mean_i[-beta p_i.g_i + logsumexp(beta g_i)]`` over ``beta >= 0``.

    ``logits`` is ``[N, K]``, ``targets`` ``[N, K]`` probability rows. Returns ``(beta, info)``
    with ``info`` = ``iterations``, ``derivative`` (at ``beta``), ``cross_entropy`` (the
    minimum), ``at_bound`` (``None``, "infinite_temperature" or "zero_temperature") and
    ``converged``. Safeguarded Newton on the monotone derivative inside a bracket, with
    bisection whenever a Newton step would leave it. The search runs on ``g / s`` (``s`` the
    mean per-row logit range), so tolerances and the cap do not depend on the logits' scale.
    """
    g = as_matrix(logits, "logits")
    p = as_matrix(targets, "targets")
    if p.shape != g.shape:
        raise ConfigError(f"targets have shape {p.shape} but logits {g.shape}; pass one "
                          "probability row per logit row.")
    if g.shape[0] == 0:
        raise FitError("no rows to fit a temperature on; pass at least one item.")
    if (p < 0).any() or np.abs(p.sum(axis=1) - 1.0).max() > 1e-6:
        raise ConfigError("targets must be probability rows (non-negative, summing to 1); "
                          f"worst row sum is off by {np.abs(p.sum(axis=1) - 1.0).max():.3g}.")
    return solve_inverse_temperature_scores(g, np.einsum("nk,nk->n", p, g))


#: Rows per chunk when the objective is evaluated over a wide vocabulary (bounds the float64
#: temporaries to ``TOKEN_CHUNK_ROWS x V`` whatever the number of rows).
TOKEN_CHUNK_ROWS = 64


def solve_inverse_temperature_scores(logits, target_scores) -> tuple[float, dict]:
    """:func:`solve_inverse_temperature` given ``target_scores[i] = p_i . g_i`` instead of the
    target rows: the objective needs the targets only through that dot product, so a
    token-level fit over a whole vocabulary keeps one float32 logit row per position and one
    number. ``logits`` ``[N, V]`` (any float dtype; evaluated in float64 row chunks)."""
    g = np.asarray(logits)
    if g.ndim != 2 or g.shape[1] < 2:
        raise ConfigError(f"logits must be an [N, K] array with K >= 2, got shape {g.shape}.")
    if g.shape[0] == 0:
        raise FitError("no rows to fit a temperature on; pass at least one item.")
    if not np.isfinite(g).all():
        raise ConfigError(f"logits have {int((~np.isfinite(g)).sum())} non-finite entries; "
                          "drop or fix those items before fitting.")
    t = np.asarray(target_scores, dtype=np.float64).reshape(-1)
    if t.shape[0] != g.shape[0] or not np.isfinite(t).all():
        raise ConfigError(f"target_scores must be {g.shape[0]} finite numbers (one per row).")
    scale = float(np.mean(g.max(axis=1).astype(np.float64) - g.min(axis=1)))
    if scale == 0.0:
        raise FitError("the logits are constant on every row, so no temperature is "
                       "identifiable; check the option-logit extraction.")
    ph = t / scale
    evaluations = 0

    def evaluate(b: float) -> tuple[float, float, float]:
        nonlocal evaluations
        evaluations += 1
        mean_h = np.empty(g.shape[0])
        var_h = np.empty(g.shape[0])
        lse = np.empty(g.shape[0])
        for start in range(0, g.shape[0], TOKEN_CHUNK_ROWS):
            h = np.asarray(g[start:start + TOKEN_CHUNK_ROWS], dtype=np.float64) / scale
            z = b * h
            m = z.max(axis=1, keepdims=True)
            e = np.exp(z - m)
            s = e.sum(axis=1, keepdims=True)
            q = e / s
            rows = slice(start, start + h.shape[0])
            mean_h[rows] = np.einsum("nk,nk->n", q, h)
            var_h[rows] = np.einsum("nk,nk->n", q, (h - mean_h[rows, None]) ** 2)
            lse[rows] = m[:, 0] + np.log(s[:, 0])
        ce = float(np.mean(-b * ph + lse))
        return float(np.mean(mean_h - ph)), float(np.mean(var_h)), ce

    def result(b: float, d: float, ce: float, at_bound: str | None, converged: bool):
        return b / scale, {"iterations": evaluations, "derivative": d * scale,
                           "cross_entropy": ce, "at_bound": at_bound, "converged": converged}

    d, curv, ce = evaluate(0.0)
    if d >= 0.0:  # the convex objective increases from beta = 0: uniform is optimal
        return result(0.0, d, ce, "infinite_temperature", True)
    lo, hi = 0.0, 1.0
    d, curv, ce = evaluate(hi)
    while d < 0.0:  # expand the upper end of the bracket
        if hi >= BETA_CAP:
            return result(hi, d, ce, "zero_temperature", True)
        lo, hi = hi, min(4.0 * hi, BETA_CAP)
        d, curv, ce = evaluate(hi)
    b = hi
    while evaluations < MAX_EVALUATIONS:
        if abs(d) < DERIVATIVE_TOL or hi - lo <= BRACKET_RTOL * hi:
            return result(b, d, ce, None, True)
        step = b - d / curv if curv > 0.0 else math.nan
        b_new = step if lo < step < hi else 0.5 * (lo + hi)
        if abs(b_new - b) <= BRACKET_RTOL * b:  # Newton has stalled at the root
            return result(b, d, ce, None, True)
        b = b_new
        d, curv, ce = evaluate(b)
        lo, hi = (b, hi) if d < 0.0 else (lo, b)
    logger.warning("temperature search stopped after %d evaluations with derivative %.3g",
                   evaluations, d)
    return result(b, d, ce, None, False)



def fit_temperature_scaling(logits, labels) -> TemperatureFit:
    """Temperature scaling with labels: ``T`` minimising the NLL of ``softmax(g / T)``."""
    g = as_matrix(logits, "logits")
    y = as_labels(labels, g.shape)
    onehot = np.zeros_like(g)
    onehot[np.arange(g.shape[0]), y] = 1.0
    return scalar_fit("ts", g, onehot, n=g.shape[0], agreement_rate=None)



def scalar_fit(method, g, p, *, n, agreement_rate) -> TemperatureFit:
    beta, info = solve_inverse_temperature(g, p)
    return temperature_fit(method, beta, info, n=n, n_used=g.shape[0],
                            agreement_rate=agreement_rate, target_entropy=mean_entropy(p))


def temperature_fit(method, beta, info, *, n, n_used, agreement_rate,
                     target_entropy) -> TemperatureFit:
    objective = info["cross_entropy"] - target_entropy  # KL; the NLL when p is one-hot
    at_bound = info["at_bound"]
    if at_bound is not None:
        logger.warning("%s temperature is at the boundary (%s, beta=%.3g): the objective "
                       "has no interior optimum on these %d items.", method, at_bound, beta,
                       n_used)
    return TemperatureFit(method=method, temperature=math.inf if beta == 0.0 else 1.0 / beta,
                          beta=beta, n=int(n), n_used=int(n_used),
                          agreement_rate=agreement_rate, objective=float(objective),
                          at_bound=at_bound, iterations=int(info["iterations"]))


def as_matrix(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 2 or a.shape[1] < 2:
        raise ConfigError(f"{name} must be an [N, K] array with K >= 2 options, got shape "
                          f"{a.shape}.")
    if not np.isfinite(a).all():
        raise ConfigError(f"{name} has {int((~np.isfinite(a)).sum())} non-finite entries; "
                          "drop or fix those items before fitting.")
    return a


def as_labels(labels, shape) -> np.ndarray:
    y = np.asarray(labels)
    if y.shape != (shape[0],) or not np.issubdtype(y.dtype, np.integer):
        raise ConfigError(f"labels must be {shape[0]} integer option indices, got shape "
                          f"{y.shape} and dtype {y.dtype}.")
    if y.size and (y.min() < 0 or y.max() >= shape[1]):
        raise ConfigError(f"labels must lie in [0, {shape[1]}), got range "
                          f"[{int(y.min())}, {int(y.max())}].")
    return y


def mean_entropy(p: np.ndarray) -> float:
    if p.shape[0] == 0:
        return 0.0
    logp = np.log(np.where(p > 0, p, 1.0))
    return float(-np.mean(np.sum(p * logp, axis=1)))
