"""Vector scaling of K-option logits (docs/methods.md §1, §3): a weight and a bias per
option, labeled (``ts-vector``) or by DACA (``daca-vector``, on its agreement set,
:func:`calm_training.methods.daca.agreement_set`), letter mode only.

Calibrated logits ``weights * g + bias`` are fitted with L-BFGS in torch (imported lazily);
:func:`vector_fit_to_tau_shift` maps a fit onto per-token ``tau`` and ``shift`` for the
engine's head, and :class:`VectorMethod` writes them there, at the option letters' token ids.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import numpy as np

from calm_runtime.errors import BackendUnavailableError, ConfigError, FitError
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_runtime.temperature import as_labels, as_matrix, mean_entropy
from calm_training.methods.daca import MIN_AGREEMENT_ITEMS, MIN_AGREEMENT_RATE, agreement_set
from calm_training.methods.fit_method import FitMethod, Fitted
from calm_training.posthoc.plan import FitPlan

__all__ = ["DACA_VECTOR", "TS_VECTOR", "VectorFit", "VectorMethod", "fit_daca_vector_scaling",
           "fit_vector_scaling", "vector_fit_to_tau_shift"]

logger = logging.getLogger(__name__)

# L-BFGS stops on these; "converged" means the final max |gradient| is tiny.
LBFGS_MAX_ITER = 500
LBFGS_TOLERANCE_GRAD = 1e-10
LBFGS_TOLERANCE_CHANGE = 1e-15
VECTOR_CONVERGED_GRAD = 1e-6


@dataclass(frozen=True)
class VectorFit:
    """Fitted vector scaling: calibrated option logits ``weights * g + bias`` (K each).

    ``bias`` is centred (mean 0): the softmax is invariant to a common shift. ``converged``
    says whether L-BFGS ended with max |gradient| <= ``VECTOR_CONVERGED_GRAD``;
    ``iterations`` is L-BFGS's iteration count. Other fields as in
    :class:`calm_runtime.temperature.TemperatureFit`.
    """

    method: str
    weights: tuple[float, ...]
    bias: tuple[float, ...]
    n: int
    n_used: int
    agreement_rate: float | None
    objective: float
    converged: bool
    iterations: int

    def scaled(self, scores: np.ndarray) -> np.ndarray:
        """The calibrated option logits ``weights * scores + bias`` of ``scores`` ``[N, K]``."""
        return scores * np.asarray(self.weights) + np.asarray(self.bias)

    def to_dict(self) -> dict:
        """A JSON-safe dict (lists for the vectors)."""
        out = dataclasses.asdict(self)
        out["weights"], out["bias"] = list(self.weights), list(self.bias)
        return out


def fit_daca_vector_scaling(plm_logits, polm_logits, *, mask: bool = True, l2: float = 0.0,
                            min_agreement: int = MIN_AGREEMENT_ITEMS,
                            min_agreement_rate: float = MIN_AGREEMENT_RATE) -> VectorFit:
    """DACA vector scaling: ``w * g + c`` minimising the masked mean KL to ``softmax(f)``.

    ``l2`` (default 0: plain maximum likelihood) adds ``l2 * (|w - 1|^2 + |c|^2)`` pulling
    toward the identity. Agreement handling as in
    :func:`~calm_training.methods.daca.fit_daca_temperature`.
    """
    p, g, n, rate = agreement_set(plm_logits, polm_logits, mask, min_agreement,
                                  min_agreement_rate)
    return _vector_fit("daca_vector" if mask else "naive_vector", g, p, n=n,
                       agreement_rate=rate, l2=l2)


def fit_vector_scaling(logits, labels, *, l2: float = 0.0) -> VectorFit:
    """Vector scaling with labels: ``w * g + c`` minimising the NLL (``l2`` as above)."""
    g = as_matrix(logits, "logits")
    y = as_labels(labels, g.shape)
    onehot = np.zeros_like(g)
    onehot[np.arange(g.shape[0]), y] = 1.0
    return _vector_fit("vector", g, onehot, n=g.shape[0], agreement_rate=None, l2=l2)


def _vector_fit(method, g, p, *, n, agreement_rate, l2) -> VectorFit:
    if not (math.isfinite(l2) and l2 >= 0.0):
        raise ConfigError(f"l2 must be a finite number >= 0, got {l2!r}.")
    if g.shape[0] == 0:
        raise FitError("no rows to fit vector scaling on; pass at least one item.")
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is in the train extra
        raise BackendUnavailableError("vector scaling needs torch; pip install "
                                      "'calm-llm[train]'") from exc
    h = torch.as_tensor(g, dtype=torch.float64)
    target = torch.as_tensor(p, dtype=torch.float64)
    k = g.shape[1]
    w = torch.ones(k, dtype=torch.float64, requires_grad=True)
    c = torch.zeros(k, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, c], lr=1.0, max_iter=LBFGS_MAX_ITER, history_size=20,
                            tolerance_grad=LBFGS_TOLERANCE_GRAD,
                            tolerance_change=LBFGS_TOLERANCE_CHANGE,
                            line_search_fn="strong_wolfe")

    def loss_fn():
        ce = -(target * torch.log_softmax(h * w + c, dim=-1)).sum(dim=-1).mean()
        return ce, ce + l2 * (((w - 1.0) ** 2).sum() + (c ** 2).sum())

    def closure():
        opt.zero_grad()
        total = loss_fn()[1]
        total.backward()
        return total

    opt.step(closure)
    iterations = int(opt.state[w].get("n_iter", 0))
    opt.zero_grad()
    ce, total = loss_fn()
    total.backward()
    grad = max(float(w.grad.abs().max()), float(c.grad.abs().max()))
    converged = bool(math.isfinite(float(total.detach())) and grad <= VECTOR_CONVERGED_GRAD)
    if not converged:
        logger.warning("%s: L-BFGS stopped after %d iterations with max |gradient| %.3g",
                       method, iterations, grad)
    weights = w.detach().numpy().copy()
    bias = c.detach().numpy().copy()
    bias -= bias.mean()
    return VectorFit(method=method, weights=tuple(float(x) for x in weights),
                     bias=tuple(float(x) for x in bias), n=int(n), n_used=int(g.shape[0]),
                     agreement_rate=agreement_rate,
                     objective=float(ce.detach()) - mean_entropy(p),
                     converged=converged, iterations=iterations)


def vector_fit_to_tau_shift(fit: VectorFit, option_token_ids, vocab_size: int,
                            temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Per-vocabulary ``(tau, shift)`` (float32, ``[V]``) that realise ``fit`` (METHODS §1).

    ``apply_calibration(z, tau, shift, temperature)`` restricted to ``option_token_ids``
    (in the fit's option order) then equals ``fit.weights * g + fit.bias`` with
    ``g = z[option_token_ids]``: ``tau_k = 1 / (w_k T)`` and ``shift_k = c_k T`` on the option
    ids, ``tau = 1``, ``shift = 0`` elsewhere. ``temperature`` is the scalar ``T`` the same
    artifact applies afterwards (1 when none). A weight ``w_k <= 0`` cannot be represented:
    ``tau`` must be positive, so it raises :class:`ConfigError`.
    """
    ids = np.asarray(option_token_ids)
    k = len(fit.weights)
    if ids.ndim != 1 or ids.shape[0] != k or not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(f"option_token_ids must be {k} integer token ids (one per option), "
                          f"got {ids.tolist()!r}.")
    if int(vocab_size) <= 0 or (ids < 0).any() or (ids >= vocab_size).any():
        raise ConfigError(f"option_token_ids {ids.tolist()} must lie in [0, {vocab_size}); "
                          "check the tokenizer the ids came from.")
    if np.unique(ids).shape[0] != k:
        raise ConfigError(f"option_token_ids {ids.tolist()} contain duplicates; each option "
                          "needs its own token.")
    if not (math.isfinite(temperature) and temperature > 0.0):
        raise ConfigError(f"temperature must be a positive finite number, got {temperature!r}.")
    w = np.asarray(fit.weights, dtype=np.float64)
    bad = np.flatnonzero(~(w > 0) | ~np.isfinite(w))
    if bad.size:
        j = int(bad[0])
        raise ConfigError(f"vector-scaling weight for option {j} (token id {int(ids[j])}) is "
                          f"{w[j]:.6g}; tau = 1/w must be positive, so a non-positive weight "
                          "cannot be represented as a per-vocabulary temperature. Re-fit "
                          "with l2 > 0 or use scalar temperature scaling.")
    tau = np.ones(int(vocab_size), dtype=np.float32)
    shift = np.zeros(int(vocab_size), dtype=np.float32)
    tau[ids] = 1.0 / (w * temperature)
    shift[ids] = np.asarray(fit.bias, dtype=np.float64) * temperature
    return tau, shift


@dataclass(frozen=True)
class VectorMethod(FitMethod):
    """Vector scaling: a weight and a bias per option, written onto the option letters'
    entries of ``tau``/``shift`` (letter mode only; docs/methods.md §1)."""

    vector = True

    def not_fitted_because(self, plan: FitPlan) -> str | None:
        """Letter-mode vector scaling is not invariant to a shift of a question's scores,
        and an endpoint returns log-probabilities (logits minus a per-question constant)
        where the local path reads logits: the fit would depend on which one it saw (and a
        served model's adapter holds temperatures only)."""
        if plan.mode.token_level and plan.served:
            return ("not fitted for a served model: vector scaling is not shift-invariant and "
                    "an endpoint returns log-probabilities, not logits; use daca, naive or ts")
        return None

    def check_writable(self, plan: FitPlan) -> None:
        super().check_writable(plan)
        if plan.served:
            raise ConfigError(f"{self.name} writes per-token weights, which need the model's "
                              "token ids; a served model takes daca, naive or ts")
        if not plan.mode.token_level:
            raise ConfigError("vector scaling of cloze scores acts on summed log-probabilities "
                              "and cannot be stored as token calibration; use daca or ts in "
                              "cloze mode, or letter mode for vector scaling")
        base, _ = plan.base
        if (base.tau != 1).any() or (base.shift != 0).any():
            raise ConfigError("vector scaling on top of an adapter that already has per-token "
                              "tau/shift is not supported; fit a scalar temperature (daca or ts)")

    def write_fit(self, adapter: CalibrationAdapter, fitted: Fitted, plan: FitPlan) -> None:
        """The weights and biases onto ``tau``/``shift`` at the token ids the option letters
        were scored at (the scores carry them), so they land where the fit read."""
        fit = fitted.fit
        if fitted.option_ids is None or len(fitted.option_ids) != len(fit.weights):
            raise ConfigError("vector scaling needs letter scores that name their option "
                              "tokens (a local model or an engine); use daca, naive or ts")
        adapter.tau, adapter.shift = vector_fit_to_tau_shift(
            fit, [int(i) for i in fitted.option_ids], adapter.base_model.vocab_size,
            temperature=adapter.temperature)


TS_VECTOR = VectorMethod("ts-vector", needs_labels=True, option_fit=fit_vector_scaling)
DACA_VECTOR = VectorMethod("daca-vector", needs_reference=True, masked=True,
                           option_fit=fit_daca_vector_scaling)
