"""``platt``: Platt scaling of P(True)'s two-way logits (docs/methods.md §5, "Platt
scaling"): a slope and an intercept on their log-odds, a temperature and a shift, compared by
``calm eval --compare --mode p_true`` and not yet written as an adapter (it needs a shift on
the true token)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from calm_runtime.errors import FitError
from calm_training.methods.fit_method import FitMethod

__all__ = ["PLATT", "PlattFit", "PlattMethod", "fit_platt"]


@dataclass(frozen=True)
class PlattFit:
    """``P(True) = sigmoid(slope * d + bias)`` with ``d = z_true - z_false``: a temperature
    (``1 / slope``) and a shift, which moves the base rate where a temperature cannot.
    Fitted by Newton's method on the binary NLL against answer correctness (convex)."""

    slope: float
    bias: float
    n_used: int
    iterations: int
    method: str = "platt"

    @property
    def temperature(self) -> float:
        return 1.0 / self.slope if self.slope else float("inf")

    def apply(self, two_way: np.ndarray) -> np.ndarray:
        d = two_way[:, 0] - two_way[:, 1]
        return 1.0 / (1.0 + np.exp(-np.clip(self.slope * d + self.bias, -700, 700)))

    def to_dict(self) -> dict:
        return {"method": self.method, "slope": self.slope, "bias": self.bias,
                "temperature": self.temperature, "n_used": self.n_used,
                "iterations": self.iterations}


def fit_platt(two_way: np.ndarray, correct: np.ndarray, *, max_iter: int = 100,
              tol: float = 1e-10) -> PlattFit:
    """Platt scaling of two-way logits against 0/1 correctness (damped Newton steps)."""
    d = two_way[:, 0] - two_way[:, 1]
    y = np.asarray(correct, dtype=float)
    if y.min() == y.max():
        raise FitError("Platt scaling needs both correct and wrong answers on the calibration "
                       "split; use more data")
    x = np.stack([d, np.ones_like(d)], axis=1)
    w = np.zeros(2)

    def loss(w):
        z = x @ w
        return float(np.mean(np.logaddexp(0.0, z) - y * z))

    iterations = 0
    for _ in range(max_iter):
        iterations += 1
        p = 1.0 / (1.0 + np.exp(-np.clip(x @ w, -700, 700)))
        grad = x.T @ (p - y) / y.size
        hess = (x * (p * (1 - p))[:, None]).T @ x / y.size + 1e-12 * np.eye(2)
        step = np.linalg.solve(hess, grad)
        scale, current = 1.0, loss(w)
        while loss(w - scale * step) > current and scale > 1e-8:
            scale /= 2
        w = w - scale * step
        if np.abs(scale * step).max() < tol:
            break
    return PlattFit(float(w[0]), float(w[1]), int(y.size), iterations)


@dataclass(frozen=True)
class PlattMethod(FitMethod):
    """Platt scaling: its P(True) is the fitted sigmoid, not a tempered two-way softmax."""

    def p_true_probabilities(self, fit, two_way: np.ndarray) -> np.ndarray:
        return fit.apply(two_way)


PLATT = PlattMethod("platt", needs_labels=True, choice=False, p_true=True, p_true_fit=fit_platt,
                    writes_adapter=False,
                    refusal="Platt scaling is compared by calm eval --compare but not written "
                            "as an adapter yet (it needs a shift on the true token)")
