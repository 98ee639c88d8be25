"""Vector scaling of K-option logits, labeled or by DACA (docs/methods.md §3): calibrated
logits ``weights * g + bias`` fitted with L-BFGS in torch (imported lazily), and the map of
a fit onto per-token ``tau`` and ``shift`` for the engine's head."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import numpy as np

from calm_runtime.errors import BackendUnavailableError, ConfigError, FitError
from calm_training.posthoc._daca_arrays import (
    MIN_AGREEMENT_ITEMS,
    MIN_AGREEMENT_RATE,
    agreement_set,
    as_labels,
    as_matrix,
    mean_entropy,
)

logger = logging.getLogger("calm_training.posthoc.daca")

__all__ = ["VectorFit", "fit_daca_vector_scaling", "fit_vector_scaling",
           "vector_fit_to_tau_shift"]

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
    ``iterations`` is L-BFGS's iteration count. Other fields as in :class:`TemperatureFit`.
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
    toward the identity. Agreement handling as in :func:`fit_daca_temperature`.
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


# ------------------------------------------------------------------------- helpers
